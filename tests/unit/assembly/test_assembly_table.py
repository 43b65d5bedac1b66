"""Table-driven checks of the non-streaming assembly rules (one case per row of the contract's table / 502 rule)."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.errors import BadEngineResponse

META = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "tiny"}
ROLE = {**META, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]}


def chat(delta: dict[str, Any], index: int = 0, **extra: Any) -> dict[str, Any]:
    return {**META, "choices": [{"index": index, "delta": delta, **extra}]}


def cmpl(text: str | None, index: int = 0, **extra: Any) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "tiny",
            "choices": [{"index": index, "text": text, **extra}]}


def tc(index: Any, id: str | None = None, name: str | None = None, args: str | None = None,
       **extra: Any) -> dict[str, Any]:
    frag: dict[str, Any] = {"index": index, **extra}
    if id is not None:
        frag["id"] = id
        frag["type"] = "function"
    fn = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    if fn:
        frag["function"] = fn
    return frag


def assemble(route: str, chunks: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    asm = Assembler(route, return_token_ids=False)  # type: ignore[arg-type]
    for chunk in chunks:
        asm.feed(chunk)
    return asm.result(**kw)


def message(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = assemble("chat", [ROLE, *chunks])["choices"][0]["message"]
    return out


LP = [{"token": t, "logprob": -1.0 * i, "bytes": [], "top_logprobs": []} for i, t in enumerate("abcd")]

ROWS: list[tuple[str, str, list[dict[str, Any]], Any, Any]] = [
    ("content", "chat", [chat({"content": "Hel"}), chat({"content": "lo"})],
     lambda r: r["choices"][0]["message"]["content"], "Hello"),
    ("reasoning", "chat", [chat({"reasoning": "thi"}), chat({"reasoning": "nk"}), chat({"content": "x"})],
     lambda r: (r["choices"][0]["message"]["reasoning"], r["choices"][0]["message"]["content"]),
     ("think", "x")),
    ("reasoning_content", "chat", [chat({"reasoning_content": "a"}), chat({"reasoning_content": "b"})],
     lambda r: (r["choices"][0]["message"]["reasoning_content"], r["choices"][0]["message"]["reasoning"]),
     ("ab", None)),
    ("refusal", "chat", [chat({"refusal": "I can"}), chat({"refusal": "not"})],
     lambda r: (r["choices"][0]["message"]["refusal"], r["choices"][0]["message"]["content"]),
     ("I cannot", None)),
    ("tool_calls", "chat",
     [chat({"tool_calls": [tc(1, id="call_", name="get_")]}),
      chat({"tool_calls": [tc(0, id="call_a", name="lookup", args='{"q":')]}),
      chat({"tool_calls": [tc(1, id="b", name="weather", args='{"city"')]}),
      chat({"tool_calls": [tc(0, args=' "x"}'), tc(1, args=': "Oslo"}')]})],
     lambda r: (r["choices"][0]["message"]["tool_calls"], r["choices"][0]["message"]["content"]),
     ([{"id": "call_a", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}},
       {"id": "call_b", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}], None)),
    ("function_call", "chat",
     [chat({"function_call": {"name": "look", "arguments": "{"}}),
      chat({"function_call": {"name": "up", "arguments": "}"}})],
     lambda r: r["choices"][0]["message"]["function_call"], {"name": "lookup", "arguments": "{}"}),
    ("chat_logprobs", "chat",
     [chat({"content": "a"}, logprobs={"content": LP[:1], "refusal": None}),
      chat({"content": "bc"}, logprobs={"content": LP[1:3]}),
      chat({"refusal": "d"}, logprobs={"content": None, "refusal": LP[3:]})],
     lambda r: r["choices"][0]["logprobs"], {"content": LP[:3], "refusal": LP[3:]}),
    ("completion_logprobs", "completion",
     [cmpl("ab", logprobs={"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "text_offset": [0, 1],
                           "top_logprobs": [{"a": -1.0}, {"b": -2.0}]}),
      cmpl("c", logprobs={"tokens": ["c"], "token_logprobs": [-3.0], "text_offset": [2],
                          "top_logprobs": [{"c": -3.0}]})],
     lambda r: (r["choices"][0]["text"], r["choices"][0]["logprobs"]),
     ("abc", {"tokens": ["a", "b", "c"], "token_logprobs": [-1.0, -2.0, -3.0], "text_offset": [0, 1, 2],
              "top_logprobs": [{"a": -1.0}, {"b": -2.0}, {"c": -3.0}]})),
]


@pytest.mark.parametrize(("name", "route", "chunks", "pick", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_assembly_table_row(name: str, route: str, chunks: list[dict[str, Any]], pick: Any,
                            expected: Any) -> None:
    lead = [ROLE] if route == "chat" else []
    assert pick(assemble(route, lead + chunks)) == expected


REFUSED: list[tuple[str, str, list[dict[str, Any]], str]] = [
    ("audio", "chat", [chat({"audio": {"id": "a1", "data": "AAA"}})], "choices.0.delta.audio"),
    ("annotations", "chat", [chat({"content": "x", "annotations": [{"type": "url_citation"}]})],
     "choices.0.delta.annotations"),
    ("custom_tool_type", "chat", [chat({"tool_calls": [{"index": 0, "id": "c", "type": "custom"}]})],
     "choices.0.delta.tool_calls.0.type"),
    ("custom_tool_output", "chat",
     [chat({"tool_calls": [{"index": 0, "id": "c", "custom": {"name": "f", "input": "x"}}]})],
     "choices.0.delta.tool_calls.0.custom"),
    ("unknown_delta_key", "chat", [chat({"content": "x", "sparkle": 1})], "choices.0.delta.sparkle"),
    ("unknown_choice_key", "chat", [chat({"content": "x"}, sparkle_score=2)], "choices.0.sparkle_score"),
    # SGLang's matched_stop and Azure's content_filter_results are kept (tests/unit/test_dialect_shapes.py), malformed refused
    ("malformed_matched_stop", "chat", [chat({"content": "x"}, matched_stop=[2])], "choices.0.matched_stop"),
    ("malformed_content_filter_results", "chat", [chat({"content": "x"}, content_filter_results="ok")],
     "choices.0.content_filter_results"),
    ("unknown_function_key", "chat",
     [chat({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "strict": True}}]})],
     "choices.0.delta.tool_calls.0.function.strict"),
    ("unknown_logprobs_key", "chat", [chat({"content": "x"}, logprobs={"content": [], "x": [1]})],
     "choices.0.logprobs.x"),
    ("unknown_completion_key", "completion", [cmpl("x", delta={"content": "y"})], "choices.0.delta"),
    ("content_not_string", "chat", [chat({"content": 5})], "choices.0.delta.content"),
    ("reasoning_not_string", "chat", [chat({"reasoning": ["a"]})], "choices.0.delta.reasoning"),
    ("delta_not_object", "chat", [chat("hi")], "choices.0.delta"),  # type: ignore[arg-type]
    ("tool_calls_not_list", "chat", [chat({"tool_calls": {"index": 0}})], "choices.0.delta.tool_calls"),
    ("tool_call_not_object", "chat", [chat({"tool_calls": ["x"]})], "choices.0.delta.tool_calls.0"),
    ("tool_index_not_int", "chat", [chat({"tool_calls": [tc("0", id="c", name="f")]})],
     "choices.0.delta.tool_calls.0.index"),
    ("tool_index_bool", "chat", [chat({"tool_calls": [tc(True, id="c", name="f")]})],
     "choices.0.delta.tool_calls.0.index"),
    ("tool_index_missing", "chat", [chat({"tool_calls": [{"id": "c"}]})],
     "choices.0.delta.tool_calls.0.index"),
    ("tool_arguments_not_string", "chat",
     [chat({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": {}}}]})],
     "choices.0.delta.tool_calls.0.function.arguments"),
    ("tool_call_without_id", "chat", [chat({"tool_calls": [tc(0, name="f", args="{}")]})],
     "choices.0.message.tool_calls.0.id"),
    ("tool_call_without_name", "chat", [chat({"tool_calls": [tc(0, id="c", args="{}")]})],
     "choices.0.message.tool_calls.0.function.name"),
    ("function_call_without_name", "chat", [chat({"function_call": {"arguments": "{}"}})],
     "choices.0.message.function_call.name"),
    ("logprobs_not_object", "chat", [chat({"content": "x"}, logprobs=[1])], "choices.0.logprobs"),
    ("logprobs_content_not_list", "chat", [chat({"content": "x"}, logprobs={"content": "x"})],
     "choices.0.logprobs.content"),
    ("logprobs_entry_not_object", "chat", [chat({"content": "x"}, logprobs={"content": [1]})],
     "choices.0.logprobs.content.0"),
    ("text_not_string", "completion", [cmpl(3)], "choices.0.text"),  # type: ignore[arg-type]
    ("tokens_not_list", "completion", [cmpl("x", logprobs={"tokens": "x"})], "choices.0.logprobs.tokens"),
    ("text_offset_not_int", "completion", [cmpl("x", logprobs={"text_offset": [0.5]})],
     "choices.0.logprobs.text_offset.0"),
    ("finish_reason_not_string", "chat", [chat({"content": "x"}, finish_reason=1)],
     "choices.0.finish_reason"),
    ("stop_reason_bool", "chat", [chat({"content": "x"}, stop_reason=True)], "choices.0.stop_reason"),
    ("choices_not_list", "chat", [{**META, "choices": {"0": {}}}], "choices"),
    ("choice_index_missing", "chat", [{**META, "choices": [{"delta": {"content": "x"}}]}],
     "choices.0.index"),
    ("token_ids_bool", "chat", [chat({"content": "x"}, token_ids=[True])], "choices.0.token_ids"),
    ("usage_malformed", "chat", [{**META, "choices": [], "usage": {"prompt_tokens": "8"}}],
     "usage.prompt_tokens"),
    ("error_frame", "chat", [{"error": {"message": "boom", "code": 500}}], "error"),
]


@pytest.mark.parametrize(("name", "route", "chunks", "param"), REFUSED, ids=[r[0] for r in REFUSED])
def test_assembly_refuses(name: str, route: str, chunks: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(BadEngineResponse) as err:
        assemble(route, chunks)
    assert err.value.status == 502
    assert err.value.param == param


@pytest.mark.parametrize("chunk", [
    chat({"content": "x", "audio": None, "annotations": None, "sparkle": None}),
    chat({"content": "x", "annotations": []}),
    chat({"content": "x"}, sparkle=None, logprobs=None, stop_reason=None, token_ids=None,
         routed_experts=None, prompt_logprobs=None),
    chat({"tool_calls": [{"index": 0, "id": "c", "type": "function", "custom": None,
                          "function": {"name": "f", "arguments": "{}", "strict": None}}]}),
    chat({"tool_calls": []}),
], ids=["null-delta-keys", "empty-annotations", "null-choice-keys", "null-tool-keys", "empty-tools"])
def test_null_valued_unknown_fields_pass(chunk: dict[str, Any]) -> None:
    assemble("chat", [ROLE, chunk])


def test_known_unassembled_top_level_fields_pass() -> None:
    frame = {**META, "choices": [], "service_tier": "default", "metrics": {"x": 1},
             "kv_transfer_params": {"remote": 1}, "ec_transfer_params": None, "prompt_text": "hi",
             "prompt_logprobs": None, "something_new": 3}
    out = assemble("chat", [ROLE, chat({"content": "x"}), frame])
    assert out["service_tier"] == "default"
    assert out["prompt_text"] == "hi"
    assert out["metrics"] == {"x": 1}
    assert "kv_transfer_params" not in out and "something_new" not in out
