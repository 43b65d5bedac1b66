"""Per-choice state common to chat and text-completion assembly."""

from __future__ import annotations

from typing import Any, ClassVar

from ._common import join, opt_list, opt_str, reject_unknown, stop_reason_of
from .tokens import validate_ids


class ChoiceFold:
    """Folds the chunks of one choice (one ``index``) into its final non-streaming form."""

    KNOWN: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, index: int) -> None:
        self.index = index
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: list[Any] | None = None

    def feed(self, choice: dict[str, Any], path: str) -> tuple[int | None, bool]:
        """Fold one choice event; return (token IDs it carried or None, whether it is a token event)."""
        reject_unknown(choice, self.KNOWN, path)
        event = self.feed_output(choice, path)
        finish = opt_str(choice, "finish_reason", path)
        if finish is not None:
            self.finish_reason = finish
        stop = stop_reason_of(choice, path)
        if stop is not None:
            self.stop_reason = stop
        n_ids: int | None = None
        ids = choice.get("token_ids")
        if ids is not None:
            checked = validate_ids(ids, join(path, "token_ids"))
            if self.token_ids is None:
                self.token_ids = []
            self.token_ids.extend(checked)
            n_ids = len(checked)
        prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids is not None:
            checked = validate_ids(prompt_ids, join(path, "prompt_token_ids"))
            if self.prompt_token_ids is None:
                self.prompt_token_ids = list(checked)
        prompt_logprobs = opt_list(choice, "prompt_logprobs", path)
        if prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = prompt_logprobs
        return n_ids, event

    def feed_output(self, choice: dict[str, Any], path: str) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def result(self, path: str, *, return_token_ids: bool) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    def token_ids_out(self) -> list[int] | None:
        return None if self.token_ids is None else list(self.token_ids)
