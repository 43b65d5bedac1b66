"""Usage: keep the engine's non-null usage, else compute it (the contract's metadata and usage rows)."""

from __future__ import annotations

from typing import Any

from ._common import bad, is_int, join

USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def check_usage(value: object, path: str = "usage") -> dict[str, Any]:
    """A copy of a non-null engine ``usage`` object, extra keys (``prompt_tokens_details``...) kept."""
    if not isinstance(value, dict):
        bad(f"Engine field {path} must be an object", path)
    for key in USAGE_COUNTS:
        count = value.get(key)
        if not is_int(count) or count < 0:
            bad(f"Engine field {join(path, key)} must be a non-negative integer", join(path, key))
    return dict(value)


def computed_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Usage Narwhal reports when the engine sent none."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage_chunk(meta: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A stream's usage chunk written by Narwhal: the stream's identity (``meta``: id, object,
    created, model), no choices, the computed usage."""
    return {**meta, "choices": [], "usage": computed_usage(prompt_tokens, completion_tokens)}
