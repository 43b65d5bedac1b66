"""Logprob accumulators: arrays concatenate in stream order.

Chat: ``{"content": [...], "refusal": [...]}`` (entries are the engine's own token objects, kept as
sent).  The assembled object always has ``content`` (null when no chunk sent a content array) and has
``refusal`` only when some chunk sent a refusal array; vLLM's non-streaming shape is ``{"content": ...}``.

Text completion: ``tokens``, ``token_logprobs``, ``text_offset`` and ``top_logprobs`` concatenate
independently; the engine's offsets are already absolute, so they are kept as sent.
"""

from __future__ import annotations

from typing import Any

from ._common import bad, is_int, is_number, join, opt_list, reject_unknown

CHAT_KEYS = frozenset({"content", "refusal"})
COMPLETION_KEYS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")
_COMPLETION_KNOWN = frozenset(COMPLETION_KEYS)


def _as_dict(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        bad(f"Engine field {path} must be an object", path)
    return value


class ChatLogprobs:
    __slots__ = ("seen", "content", "refusal")

    def __init__(self) -> None:
        self.seen = False
        self.content: list[Any] | None = None
        self.refusal: list[Any] | None = None

    def feed(self, value: object, path: str) -> None:
        """Add one chunk's non-null ``logprobs`` object."""
        lp = _as_dict(value, path)
        reject_unknown(lp, CHAT_KEYS, path)
        self.seen = True
        content = opt_list(lp, "content", path)
        if content is not None:
            _check_entries(content, join(path, "content"))
            if self.content is None:
                self.content = []
            self.content.extend(content)
        refusal = opt_list(lp, "refusal", path)
        if refusal is not None:
            _check_entries(refusal, join(path, "refusal"))
            if self.refusal is None:
                self.refusal = []
            self.refusal.extend(refusal)

    def result(self) -> dict[str, Any] | None:
        if not self.seen:
            return None
        out: dict[str, Any] = {"content": None if self.content is None else list(self.content)}
        if self.refusal is not None:
            out["refusal"] = list(self.refusal)
        return out


def _check_entries(entries: list[Any], path: str) -> None:
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            bad(f"Engine field {join(path, i)} must be an object", join(path, i))
        _check_entry(entry, join(path, i))
        top = entry.get("top_logprobs")
        if top is not None:
            if not isinstance(top, list):
                bad(f"Engine field {join(path, i)}.top_logprobs must be a list", f"{join(path, i)}.top_logprobs")
            for j, alt in enumerate(top):
                if not isinstance(alt, dict):
                    bad(f"Engine field {join(path, i)}.top_logprobs.{j} must be an object", f"{join(path, i)}.top_logprobs.{j}")
                _check_entry(alt, f"{join(path, i)}.top_logprobs.{j}")


def _check_entry(entry: dict[str, Any], path: str) -> None:
    """One token's logprob, as vLLM's (and OpenAI's) schema has it: ``token`` a string,
    ``logprob`` a number, ``bytes`` null or a list of byte values."""
    if not isinstance(entry.get("token"), str):
        bad(f"Engine field {path}.token must be a string", f"{path}.token")
    logprob = entry.get("logprob")
    if logprob is not None and not is_number(logprob):
        bad(f"Engine field {path}.logprob must be a number", f"{path}.logprob")
    raw = entry.get("bytes")
    if raw is not None and not (isinstance(raw, list) and all(is_int(b) and 0 <= b <= 255 for b in raw)):
        bad(f"Engine field {path}.bytes must be a list of byte values", f"{path}.bytes")


class CompletionLogprobs:
    __slots__ = ("seen", "arrays")

    def __init__(self) -> None:
        self.seen = False
        self.arrays: dict[str, list[Any]] = {key: [] for key in COMPLETION_KEYS}

    def feed(self, value: object, path: str) -> None:
        """Add one chunk's non-null ``logprobs`` object."""
        lp = _as_dict(value, path)
        reject_unknown(lp, _COMPLETION_KNOWN, path)
        self.seen = True
        arrays: dict[str, list[Any]] = {}
        for key in COMPLETION_KEYS:
            items = opt_list(lp, key, path)
            if items is None:
                continue
            base = join(path, key)
            for i, item in enumerate(items):
                if not _item_ok(key, item):
                    bad(f"Engine field {join(base, i)} has the wrong type", join(base, i))
            arrays[key] = items
        # parallel arrays, an entry per token (misaligned, the offsets name other tokens); SGLang
        # sends [] for top_logprobs when asked for none
        if len({len(v) for k, v in arrays.items() if v or k != "top_logprobs"}) > 1:
            bad(f"Engine field {path} has arrays of different lengths", path)
        for key, items in arrays.items():
            self.arrays[key].extend(items)

    def result(self) -> dict[str, Any] | None:
        if not self.seen:
            return None
        return {key: list(self.arrays[key]) for key in COMPLETION_KEYS}


def _item_ok(key: str, item: object) -> bool:
    if key == "tokens":
        return isinstance(item, str)
    if key == "text_offset":
        return is_int(item)
    if key == "token_logprobs":
        return item is None or is_number(item)
    return item is None or isinstance(item, dict)  # top_logprobs
