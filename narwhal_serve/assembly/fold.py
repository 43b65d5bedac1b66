"""Non-streaming assembly: fold an engine's SSE chunks into one final response (the contract's non-streaming
assembly; Metadata and usage; Token identity).

Feed every parsed ``data:`` chunk (raw, before :func:`~narwhal_serve.assembly.exposure.expose`) in
order to :meth:`Assembler.feed`, then call :meth:`Assembler.result`.  The result has vLLM's own
non-streaming shape (``chat.completion`` / ``text_completion``).  Choices group by their ``index`` and
come back in index order.

What is kept:

* metadata: ``id``, ``created``, ``model`` from the first chunk carrying them (not blank: ``""`` or
  0); ``system_fingerprint``,
  ``service_tier`` and ``metrics`` from the last chunk carrying a non-null value;
* ``finish_reason`` / ``stop_reason``: the last non-null value per choice, so a later usage-only frame
  (``choices: []``) or null-valued chunk never erases them; so are other dialects' per-choice
  ``matched_stop`` (SGLang) and ``content_filter_results`` (Azure OpenAI), returned only when sent;
* usage: the last non-null engine ``usage`` as sent (extra keys kept); when the engine sent none,
  ``{"prompt_tokens", "completion_tokens", "total_tokens"}`` computed from the ``prompt_tokens``
  argument (else the prompt token IDs' length, else 0) and :attr:`Assembler.output_tokens`; with
  ``prompt_tokens_details`` / ``completion_tokens_details`` null where none came (vLLM's
  non-streaming shape; its streamed usage leaves them out);
* ``token_ids`` / ``prompt_token_ids`` null unless the client asked for ``return_token_ids`` (as
  vLLM answers a client that did not); ``kv_transfer_params`` / ``ec_transfer_params`` never.

What is refused (:class:`~narwhal_serve.errors.BadEngineResponse`, HTTP 502, ``param`` = field path):
choice or delta (and tool-call, function, logprobs) keys Narwhal does not assemble that carry a value
(``audio``, ``annotations``, custom tool output, anything unknown; null / empty passes); malformed
supported fields; a tool call without an id or function name (at :meth:`result`); and an in-stream
``error`` object.  Unknown *top-level* keys are ignored (dropped), not refused.
"""

from __future__ import annotations

from typing import Any, Literal

from ._common import bad, carries_value, index_of, is_int
from .chat_fold import ChatChoiceFold
from .choice_base import ChoiceFold
from .completion_fold import CompletionChoiceFold
from .tokens import choices_of, validate_ids
from .usage import check_usage, computed_usage

Route = Literal["chat", "completion"]

_FIRST_WINS = (("id", str), ("created", int), ("model", str), ("prompt_text", str), ("prompt_logprobs", list))
_LAST_WINS = (("system_fingerprint", str), ("service_tier", str))
# blank ("" or 0) in a chunk that does not name the answer yet: Azure OpenAI's first chunk carries
# only the prompt's filter results, with ``id: ""``, ``created: 0`` and ``model: ""``
_BLANK_UNTIL_SET = frozenset({"id", "created", "model"})


class Assembler:
    """Folds one engine stream (chat or text completion) into the final non-streaming response."""

    def __init__(self, route: Route, *, return_token_ids: bool, forced_tool_content: str | None = None) -> None:
        """``forced_tool_content``: a chat message's ``content`` when no delta carried any — null,
        or the engine's own non-streaming value where it differs (vLLM 0.32 answers ``""`` for a
        chat whose ``tool_choice`` forces a tool: chat_completion/serving.py ``content or ""``)."""
        if route not in ("chat", "completion"):
            raise ValueError(f"unknown route {route!r}")
        self.route: Route = route
        self.return_token_ids = return_token_ids
        self.forced_tool_content = forced_tool_content
        self._choices: dict[int, ChoiceFold] = {}
        self._meta: dict[str, Any] = {}
        self._blank: dict[str, Any] = {}  # _BLANK_UNTIL_SET values that were blank
        self._usage: dict[str, Any] | None = None
        self._prompt_ids: list[int] | None = None
        self._ids_seen = False
        self._id_count = 0
        self._events = 0

    # ------------------------------------------------------------------ feeding

    def feed(self, chunk: dict[str, Any]) -> None:
        """Fold one parsed engine chunk; 502 on anything Narwhal cannot assemble faithfully."""
        choices = choices_of(chunk)
        error = chunk.get("error")
        if carries_value(error):
            detail = error.get("message") if isinstance(error, dict) else error
            bad(f"Engine reported an error mid-stream: {detail}", "error")
        self._feed_meta(chunk)
        for i, choice in enumerate(choices):
            path = f"choices.{i}"
            if not isinstance(choice, dict):
                bad(f"Engine field {path} must be an object", path)
            index = index_of(choice, path)
            fold = self._choices.get(index)
            if fold is None:
                fold = self._choices[index] = (
                    ChatChoiceFold(index, no_content=self.forced_tool_content) if self.route == "chat"
                    else CompletionChoiceFold(index))
            n_ids, event = fold.feed(choice, path)
            if n_ids is not None:
                self._ids_seen = True
                self._id_count += n_ids
            if event:
                self._events += 1
        usage = chunk.get("usage")
        if usage is not None:
            self._usage = check_usage(usage)

    def _feed_meta(self, chunk: dict[str, Any]) -> None:
        for key, kind in _FIRST_WINS:
            value = chunk.get(key)
            if value is None:
                continue
            self._check_type(key, value, kind)
            if key in _BLANK_UNTIL_SET and not value:  # ("" or 0: kept only if nothing else comes)
                self._blank.setdefault(key, value)
                continue
            self._meta.setdefault(key, value)
        for key, kind in _LAST_WINS:
            value = chunk.get(key)
            if value is not None:
                self._check_type(key, value, kind)
                self._meta[key] = value
        metrics = chunk.get("metrics")
        if metrics is not None:
            self._meta["metrics"] = metrics
        prompt_ids = chunk.get("prompt_token_ids")
        if prompt_ids is not None:
            checked = validate_ids(prompt_ids, "prompt_token_ids")
            if self._prompt_ids is None:
                self._prompt_ids = list(checked)

    @staticmethod
    def _check_type(key: str, value: object, kind: type) -> None:
        ok = is_int(value) if kind is int else isinstance(value, kind)
        if not ok:
            bad(f"Engine field {key} has the wrong type", key)

    # ------------------------------------------------------------------ reading

    @property
    def output_tokens(self) -> int:
        """Validated token IDs seen when any chunk carried IDs, else the count of token events."""
        return self._id_count if self._ids_seen else self._events

    def _first(self) -> ChoiceFold | None:
        return self._choices[min(self._choices)] if self._choices else None

    @property
    def finish_reason(self) -> str | None:
        """The finish reason of the lowest-index choice (None until one arrives)."""
        first = self._first()
        return None if first is None else first.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        first = self._first()
        return None if first is None else first.stop_reason

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """Prompt IDs from the engine (chat: top level; completion: the lowest-index choice)."""
        if self._prompt_ids is not None:
            return list(self._prompt_ids)
        first = self._first()
        if first is None or first.prompt_token_ids is None:
            return None
        return list(first.prompt_token_ids)

    def usage(self, *, prompt_tokens: int | None = None) -> dict[str, Any]:
        """The engine's non-null usage if any chunk had one, else computed usage; in vLLM's
        non-streaming shape, its details null where none came (its streamed usage leaves them out)."""
        if self._usage is not None:
            out = dict(self._usage)
        else:
            if prompt_tokens is None:
                ids = self.prompt_token_ids
                prompt_tokens = 0 if ids is None else len(ids)
            out = computed_usage(prompt_tokens, self.output_tokens)
        out.setdefault("prompt_tokens_details", None)
        out.setdefault("completion_tokens_details", None)
        return out

    def result(self, *, prompt_tokens: int | None = None) -> dict[str, Any]:
        """The assembled non-streaming response (a fresh dict; may be called more than once)."""
        choices = [
            self._choices[index].result(f"choices.{pos}", return_token_ids=self.return_token_ids)
            for pos, index in enumerate(sorted(self._choices))
        ]
        meta = {**self._blank, **self._meta}
        out: dict[str, Any] = {
            "id": meta.get("id"),
            "object": "chat.completion" if self.route == "chat" else "text_completion",
            "created": meta.get("created"),
            "model": meta.get("model"),
            "choices": choices,
            "service_tier": meta.get("service_tier"),
            "system_fingerprint": meta.get("system_fingerprint"),
            "usage": self.usage(prompt_tokens=prompt_tokens),
        }
        if self.route == "chat":
            out["prompt_logprobs"] = meta.get("prompt_logprobs")
            out["prompt_token_ids"] = self.prompt_token_ids if self.return_token_ids else None
            out["prompt_text"] = meta.get("prompt_text")
        out["metrics"] = meta.get("metrics")
        return out
