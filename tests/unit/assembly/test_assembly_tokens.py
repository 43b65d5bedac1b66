"""Token identity checks (docs/contract.md, "Engine dialects and token identity")."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal_serve.assembly.tokens import check_prompt_token_ids, check_token_ids
from narwhal_serve.errors import BadEngineResponse

ROLE_ONLY = {"id": "c", "object": "chat.completion.chunk", "choices": [
    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
    "prompt_token_ids": [3, 57, 804], "prompt_text": None}


def chat(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "delta": delta, **extra}]}


def cmpl(text: str, **extra: Any) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "text": text, **extra}]}


def test_role_only_first_chunk_passes() -> None:
    assert check_token_ids(ROLE_ONLY, "chat") == 0


def test_usage_only_frame_passes() -> None:
    assert check_token_ids({"choices": [], "usage": {"prompt_tokens": 1}}, "chat") == 0


@pytest.mark.parametrize(("route", "chunk", "count"), [
    ("chat", chat({"content": "11"}, token_ids=[1257]), 1),
    ("chat", chat({"content": ""}, token_ids=[126]), 1),  # a token that decodes to nothing
    ("chat", chat({"reasoning": "hm"}, token_ids=[1, 2, 3]), 3),
    ("chat", chat({"tool_calls": [{"index": 0, "id": "x"}]}, token_ids=[0, 9]), 2),
    ("chat", chat({}, finish_reason="stop", token_ids=[]), 0),
    ("completion", cmpl("ab", token_ids=[4, 5], prompt_token_ids=None), 2),
    ("chat", {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [1]},
                          {"index": 1, "delta": {"content": "b"}, "token_ids": [2, 3]}]}, 3),
], ids=["content", "empty-content", "reasoning", "tool-calls", "finish-only", "completion", "two-choices"])
def test_counts(route: str, chunk: dict[str, Any], count: int) -> None:
    assert check_token_ids(chunk, route) == count  # type: ignore[arg-type]


@pytest.mark.parametrize(("route", "chunk"), [
    ("chat", chat({"content": "x"}, token_ids=[True])),
    ("chat", chat({"content": "x"})),  # omitted
    ("chat", chat({"content": "x"}, token_ids=None)),  # null on a content event
    ("chat", chat({"refusal": "no"})),
    ("chat", chat({"reasoning_content": "r"})),
    ("chat", chat({"function_call": {"name": "f"}})),
    ("chat", chat({"tool_calls": [{"index": 0}]})),
    ("chat", chat({"content": "x"}, token_ids=[-1])),
    ("chat", chat({"content": "x"}, token_ids="x")),
    ("chat", chat({"content": "x"}, token_ids=[1.5])),
    ("chat", chat({"content": "x"}, token_ids=["1"])),
    ("chat", chat({"content": ""}, token_ids=[False])),  # present lists are always checked
    ("chat", chat({"role": "assistant", "content": ""}, token_ids={"0": 1})),
    ("completion", cmpl("x")),
    ("completion", cmpl("x", token_ids=[1, None])),
], ids=["bool", "missing", "null", "refusal", "reasoning_content", "function_call", "tool_calls",
        "negative", "string", "float", "string-id", "bool-on-empty", "dict", "completion-missing",
        "completion-none-id"])
def test_bad_ids_fail(route: str, chunk: dict[str, Any]) -> None:
    with pytest.raises(BadEngineResponse) as err:
        check_token_ids(chunk, route)  # type: ignore[arg-type]
    assert err.value.param == "choices.0.token_ids"
    assert err.value.status == 502


def test_second_choice_param() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [1]},
                         {"index": 1, "delta": {"content": "b"}}]}
    with pytest.raises(BadEngineResponse) as err:
        check_token_ids(chunk, "chat")
    assert err.value.param == "choices.1.token_ids"


def test_malformed_frames_fail() -> None:
    with pytest.raises(BadEngineResponse) as err:
        check_token_ids({"choices": "x"}, "chat")
    assert err.value.param == "choices"
    with pytest.raises(BadEngineResponse) as err:
        check_token_ids({"choices": [{"index": 0, "delta": "x"}]}, "chat")
    assert err.value.param == "choices.0.delta"


def test_prompt_token_ids() -> None:
    assert check_prompt_token_ids(ROLE_ONLY, "chat") == [3, 57, 804]
    assert check_prompt_token_ids(chat({"content": "x"}), "chat") is None
    assert check_prompt_token_ids(cmpl("x", prompt_token_ids=[0, 1]), "completion") == [0, 1]
    assert check_prompt_token_ids(cmpl("x", prompt_token_ids=None), "completion") is None
    with pytest.raises(BadEngineResponse) as err:
        check_prompt_token_ids({**ROLE_ONLY, "prompt_token_ids": [1, True]}, "chat")
    assert err.value.param == "prompt_token_ids"
    with pytest.raises(BadEngineResponse) as err:
        check_prompt_token_ids(cmpl("x", prompt_token_ids=[-3]), "completion")
    assert err.value.param == "choices.0.prompt_token_ids"
