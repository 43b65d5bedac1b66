"""Per-choice state common to chat and text-completion assembly."""

from __future__ import annotations

from typing import Any, ClassVar

from ._common import bad, join, opt_list, opt_str, reject_unknown, stop_reason_of
from .tokens import validate_ids

# Other dialects' per-choice fields, kept as sent (the last non-null, non-empty value) and returned only when
# the engine sent one: SGLang's ``matched_stop`` (the stop string or token ID that ended the
# choice; null until then) and Azure OpenAI's ``content_filter_results`` (an object)
KEPT_FIELDS = frozenset({"matched_stop", "content_filter_results"})


def _kept_ok(key: str, value: object) -> bool:
    if key == "matched_stop":
        return isinstance(value, (str, int)) and not isinstance(value, bool)
    return isinstance(value, dict)


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
        self.kept: dict[str, Any] = {}  # KEPT_FIELDS the engine sent

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
        for key in KEPT_FIELDS:
            value = choice.get(key)
            if value is not None and value != {}:  # (Azure's finish chunk carries empty results)
                if not _kept_ok(key, value):
                    bad(f"Engine field {join(path, key)} has the wrong type", join(path, key))
                self.kept[key] = value
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
