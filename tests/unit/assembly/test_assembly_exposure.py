"""What of an engine chunk reaches the client (docs/contract.md, "Engine dialects and token identity")."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from narwhal_serve.assembly.exposure import expose

CHAT: dict[str, Any] = {
    "id": "c", "object": "chat.completion.chunk",
    "choices": [{"index": 0, "delta": {"content": "a", "kv_transfer_params": None},
                 "logprobs": None, "finish_reason": None, "token_ids": [7], "kv_transfer_params": {"x": 1}}],
    "prompt_token_ids": [1, 2], "prompt_text": None,
    "kv_transfer_params": {"remote_engine_id": "e"}, "ec_transfer_params": None,
}
CMPL: dict[str, Any] = {
    "id": "c", "object": "text_completion",
    "choices": [{"index": 0, "text": "a", "token_ids": [7], "prompt_token_ids": [1, 2],
                 "logprobs": None, "stop_reason": None}],
    "kv_transfer_params": None,
}


def _has(obj: Any, key: str) -> bool:
    if isinstance(obj, dict):
        return key in obj or any(_has(v, key) for v in obj.values())
    if isinstance(obj, list):
        return any(_has(v, key) for v in obj)
    return False


@pytest.mark.parametrize("chunk", [CHAT, CMPL], ids=["chat", "completion"])
def test_ids_stripped_when_not_requested(chunk: dict[str, Any]) -> None:
    out = expose(copy.deepcopy(chunk), return_token_ids=False)
    for key in ("kv_transfer_params", "ec_transfer_params"):
        assert not _has(out, key), key
    # the IDs the router asked for are hidden as vLLM streams them to a client that did not: null
    assert out["choices"][0]["token_ids"] is None
    assert (out["choices"][0] if "text" in out["choices"][0] else out)["prompt_token_ids"] is None
    assert out["choices"][0]["logprobs"] is None  # engine shape (null fields) otherwise kept
    assert "stop_reason" in out["choices"][0] or "delta" in out["choices"][0]


def test_ids_kept_when_requested() -> None:
    out = expose(copy.deepcopy(CHAT), return_token_ids=True)
    assert out["choices"][0]["token_ids"] == [7]
    assert out["prompt_token_ids"] == [1, 2]
    assert out["prompt_text"] is None
    assert not _has(out, "kv_transfer_params") and not _has(out, "ec_transfer_params")
    out2 = expose(copy.deepcopy(CMPL), return_token_ids=True)
    assert out2["choices"][0]["prompt_token_ids"] == [1, 2]
    assert "kv_transfer_params" not in out2


def test_expose_mutates_in_place_and_passes_other_frames() -> None:
    chunk = copy.deepcopy(CHAT)
    assert expose(chunk, return_token_ids=False) is chunk
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    assert expose(copy.deepcopy(usage), return_token_ids=False) == usage
