"""Metadata, usage, choice grouping and null-vs-empty rules of the assembler."""

from __future__ import annotations

from typing import Any

from narwhal_serve.assembly.fold import Assembler

META = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 11, "model": "m"}


NO_DETAILS = {"prompt_tokens_details": None, "completion_tokens_details": None}  # (vLLM's non-streaming usage)

def chat(delta: dict[str, Any], index: int = 0, **extra: Any) -> dict[str, Any]:
    return {**META, "choices": [{"index": index, "delta": delta, **extra}]}


def role(index: int = 0) -> dict[str, Any]:
    return chat({"role": "assistant", "content": ""}, index, logprobs=None, finish_reason=None)


def run(route: str, chunks: list[dict[str, Any]], *, ids: bool = False) -> Assembler:
    asm = Assembler(route, return_token_ids=ids)  # type: ignore[arg-type]
    for chunk in chunks:
        asm.feed(chunk)
    return asm


def test_choices_grouped_by_index_in_index_order() -> None:
    out = run("chat", [role(1), role(0), chat({"content": "b1"}, 1), chat({"content": "a1"}, 0),
                       chat({"content": "b2"}, 1, finish_reason="stop"),
                       chat({"content": "a2"}, 0, finish_reason="length")]).result()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in out["choices"]] == ["a1a2", "b1b2"]
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "stop"]


def test_completion_choices_grouped() -> None:
    chunks = [{"id": "x", "choices": [{"index": 1, "text": "B"}, {"index": 0, "text": "A"}]},
              {"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}]
    out = run("completion", chunks).result()
    assert [c["text"] for c in out["choices"]] == ["Aa", "B"]


def test_content_null_vs_empty() -> None:
    only_role = run("chat", [role(), chat({}, finish_reason="stop")]).result()["choices"][0]["message"]
    assert only_role["content"] is None
    tool_only = run("chat", [role(), chat({"tool_calls": [
        {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})])
    msg = tool_only.result()["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "f"
    empty_token = run("chat", [role(), chat({"content": ""}, finish_reason="length")])
    msg = empty_token.result()["choices"][0]["message"]
    assert msg["content"] == ""
    assert "tool_calls" not in msg and "reasoning_content" not in msg and msg["reasoning"] is None
    assert empty_token.output_tokens == 1  # one token event, no IDs


def test_metadata_retained() -> None:
    out = run("chat", [role(), chat({"content": "x"}),
                       {**META, "id": "other", "choices": [], "system_fingerprint": "fp",
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                                  "prompt_tokens_details": {"cached_tokens": 2}}}]).result()
    assert (out["id"], out["created"], out["model"], out["object"]) == ("chatcmpl-9", 11, "m",
                                                                        "chat.completion")
    assert out["system_fingerprint"] == "fp"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                            "prompt_tokens_details": {"cached_tokens": 2}, "completion_tokens_details": None}


def test_last_non_null_usage_wins() -> None:
    u1 = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    u2 = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    out = run("chat", [role(), {**chat({"content": "a"}), "usage": u1},
                       {**chat({"content": "b"}), "usage": u2}, {**chat({}), "usage": None}]).result()
    assert out["usage"] == {**u2, **NO_DETAILS}


def test_computed_usage() -> None:
    chunks = [{**role(), "prompt_token_ids": [1, 2, 3]},
              chat({"content": "a"}, token_ids=[10, 11]), chat({"content": "b"}, token_ids=[12])]
    asm = run("chat", chunks, ids=True)
    assert asm.output_tokens == 3
    assert asm.result()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, **NO_DETAILS}
    assert asm.result(prompt_tokens=10)["usage"] == {"prompt_tokens": 10, "completion_tokens": 3,
                                                     "total_tokens": 13, **NO_DETAILS}
    out = asm.result()
    assert out["choices"][0]["token_ids"] == [10, 11, 12] and out["prompt_token_ids"] == [1, 2, 3]
    hidden = run("chat", chunks, ids=False).result()
    assert hidden["choices"][0]["token_ids"] is None and hidden["prompt_token_ids"] is None  # (vLLM's shape)
    assert hidden["usage"]["prompt_tokens"] == 3  # still measured from the engine's IDs


def test_result_is_repeatable_and_fresh() -> None:
    asm = run("chat", [role(), chat({"content": "a"}, logprobs={"content": [{"token": "a", "logprob": 0}]})])
    first = asm.result()
    first["choices"][0]["logprobs"]["content"].append("junk")
    assert asm.result()["choices"][0]["logprobs"]["content"] == [{"token": "a", "logprob": 0}]


def test_accessors_before_any_choice() -> None:
    asm = Assembler("chat", return_token_ids=False)
    assert asm.finish_reason is None and asm.stop_reason is None and asm.output_tokens == 0
    assert asm.result()["choices"] == []


def test_stop_reason_token_id_and_later_null() -> None:
    asm = run("chat", [role(), chat({"content": "a"}, finish_reason="stop", stop_reason=2),
                       chat({}, finish_reason=None, stop_reason=None)])
    assert (asm.finish_reason, asm.stop_reason) == ("stop", 2)
