"""The simulator's tokenizer as the router loads it (``tokenizer: narwhal-sim``, the default for the
embedded simulated fleet): the same functions the simulated engines size their prompts with
(:mod:`narwhal_serve.sim.textgen`), so the router knows a simulated prompt's exact token IDs the way
it knows a vLLM engine's from the model's Hugging Face tokenizer."""

from __future__ import annotations

from typing import Any

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.textgen import VOCAB_SIZE, encode_prompt, render_chat, token_str, tokenize_text
from narwhal_serve.tokenization.cache import TokenCache
from narwhal_serve.tokenization.chat import NotExact
from narwhal_serve.tokenization.hf import Encoded, text_prompt

SOURCE = "narwhal-sim"


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


CACHED_CHARS = 256  # message contents this long are tokenized once (a conversation's earlier turns)


class SimTokenizer:
    source = SOURCE
    vocab_size = VOCAB_SIZE
    max_model_len: int | None = SimEngineConfig.model_fields["max_model_len"].default

    def __init__(self) -> None:
        self._tokenize = TokenCache(tokenize_text, CACHED_CHARS)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return encode_prompt(text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(token_str(i) for i in ids)

    def token_strs(self, ids: list[int]) -> list[str | None]:
        return [token_str(i) for i in ids]

    def prompt(self, route: str, body: dict[str, Any]) -> Encoded:
        flag = "add_generation_prompt" if route == "chat" else "add_special_tokens"
        if not isinstance(value := body.get(flag, True), bool):  # (the engine reads it its own way, or refuses it)
            raise NotExact(f"{flag} is not a boolean")
        if route == "chat":
            msgs = [(str(m.get("role", "")), _text(m.get("content"))) for m in body["messages"]]
            return Encoded(render_chat(msgs, value, self._tokenize), False)
        return Encoded(encode_prompt(text_prompt(body), value), value)
