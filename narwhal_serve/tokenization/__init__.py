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
* :mod:`.forward` — whether a prompt goes to its engine as those IDs (checked against the engine's own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

from narwhal_serve.protocol.estimate import CHARS_PER_TOKEN, estimate_tokens

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "Encoded": "hf",
    "NotExact": "chat",
    "ForwardMode": "forward",
    "PromptIdForwarding": "forward",
    "PromptSizer": "sizer",
    "Sized": "sizer",
    "TokenCache": "cache",
    "Tokenizer": "sizer",
    "outside_vocabulary": "sizer",
    "text_prompt": "hf",
    "tokenizer_at": "sizer",
    "tokenizer_path": "sizer",
}
__all__ = [
    "CHARS_PER_TOKEN", "Encoded", "ForwardMode", "NotExact", "PromptIdForwarding", "PromptSizer", "Sized", "TokenCache", "Tokenizer",
    "estimate_tokens", "outside_vocabulary", "text_prompt", "tokenizer_at", "tokenizer_path",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.tokenization.hf import Encoded as Encoded
    from narwhal_serve.tokenization.chat import NotExact as NotExact
    from narwhal_serve.tokenization.forward import ForwardMode as ForwardMode
    from narwhal_serve.tokenization.forward import PromptIdForwarding as PromptIdForwarding
    from narwhal_serve.tokenization.sizer import PromptSizer as PromptSizer
    from narwhal_serve.tokenization.sizer import Sized as Sized
    from narwhal_serve.tokenization.cache import TokenCache as TokenCache
    from narwhal_serve.tokenization.sizer import Tokenizer as Tokenizer
    from narwhal_serve.tokenization.sizer import outside_vocabulary as outside_vocabulary
    from narwhal_serve.tokenization.hf import text_prompt as text_prompt
    from narwhal_serve.tokenization.sizer import tokenizer_at as tokenizer_at
    from narwhal_serve.tokenization.sizer import tokenizer_path as tokenizer_path
