"""Text-completion choice assembly: ``text`` concatenates, logprob arrays concatenate.

The assembled choice has vLLM's non-streaming shape: ``index``, ``text`` (``""`` when nothing was
generated), ``logprobs``, ``finish_reason``, ``stop_reason``, ``token_ids`` (null unless the client
asked for token IDs), ``prompt_logprobs``, ``prompt_token_ids`` (null unless asked) and
``routed_experts`` (always null: not assembled; a value from the engine is a 502).
"""

from __future__ import annotations

from typing import Any

from ._common import join, opt_str
from .choice_base import KEPT_FIELDS, ChoiceFold
from .logprobs import CompletionLogprobs


class CompletionChoiceFold(ChoiceFold):
    KNOWN = frozenset({"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                       "prompt_token_ids", "prompt_logprobs"}) | KEPT_FIELDS

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.text: list[str] = []
        self.logprobs = CompletionLogprobs()

    def feed_output(self, choice: dict[str, Any], path: str) -> bool:
        text = opt_str(choice, "text", path)
        if text is not None:
            self.text.append(text)
        lp = choice.get("logprobs")
        if lp is not None:
            self.logprobs.feed(lp, join(path, "logprobs"))
        return text is not None

    def result(self, path: str, *, return_token_ids: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "text": "".join(self.text),
            "logprobs": self.logprobs.result(),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            **self.kept,
        }
        out["token_ids"] = self.token_ids_out() if return_token_ids else None
        out["prompt_logprobs"] = self.prompt_logprobs
        out["prompt_token_ids"] = (
            None if not return_token_ids or self.prompt_token_ids is None else list(self.prompt_token_ids))
        out["routed_experts"] = None
        return out
