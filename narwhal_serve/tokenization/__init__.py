"""Prompt sizing: the model's own tokenizer where the router has it, else one estimate.

* ``protocol/estimate.py`` (re-exported here) — the single copy of the characters-per-token estimate
  (engines whose tokenizer the router cannot load, and requests it cannot render exactly, such as
  media parts); it lives in the contract layer, since request validation sizes prompts with it.
* :mod:`.chat` — chat requests turned into the conversation a vLLM engine hands its chat template
  (text content only), and the template's content format, as vLLM 0.32's renderer does.
* :mod:`.hf` — a Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``):
  chat rendering through ``transformers`` (the engine's own library) and encoding through
  ``tokenizers``.
* :mod:`.sizer` — per request: exact IDs off the event loop, or the estimate, and which it was.
"""

from narwhal_serve.protocol.estimate import CHARS_PER_TOKEN, estimate_tokens

__all__ = ["CHARS_PER_TOKEN", "estimate_tokens"]
