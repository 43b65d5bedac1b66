"""Property: any response, split into any stream of deltas, assembles back to that response."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.assembly.tokens import check_token_ids

META = {"id": "chatcmpl-p", "object": "chat.completion.chunk", "created": 1, "model": "m"}

texts = st.text(max_size=24)
opt_texts = st.none() | texts
names = st.text(min_size=1, max_size=8)
chat_lp = st.fixed_dictionaries({
    "token": st.text(max_size=4),
    "logprob": st.floats(-100, 0, allow_nan=False),
    "bytes": st.lists(st.integers(0, 255), max_size=4),
    "top_logprobs": st.just([]),
})
opt_lps = st.none() | st.lists(chat_lp, max_size=6)
tool = st.tuples(names, names, texts)  # id, function name, arguments
ids = st.lists(st.integers(0, 2**31), max_size=3)


def split(data: st.DataObject, seq: Any) -> list[Any]:
    """Any split of ``seq`` (a string or list) into >= 1 consecutive pieces, empty pieces allowed."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(seq)), max_size=5)))
    bounds = [0, *cuts, len(seq)]
    return [seq[a:b] for a, b in zip(bounds, bounds[1:])]


def interleave(data: st.DataObject, streams: dict[str, list[Any]]) -> list[Any]:
    """Merge streams in any order that keeps each stream's own order."""
    labels = [label for label, items in streams.items() for _ in items]
    order = data.draw(st.permutations(labels))
    queues = {label: list(items) for label, items in streams.items()}
    return [queues[label].pop(0) for label in order]


def tool_fragments(data: st.DataObject, index: int, call: tuple[str, str, str]) -> list[dict[str, Any]]:
    id_parts, name_parts, arg_parts = (split(data, s) for s in call)
    frags = []
    for j in range(max(len(id_parts), len(name_parts), len(arg_parts))):
        frag: dict[str, Any] = {"index": index}
        if j < len(id_parts):
            frag["id"] = id_parts[j]
        if j == 0:
            frag["type"] = "function"
        fn = {}
        if j < len(name_parts):
            fn["name"] = name_parts[j]
        if j < len(arg_parts):
            fn["arguments"] = arg_parts[j]
        if fn:
            frag["function"] = fn
        frags.append(frag)
    return frags


@settings(max_examples=300, deadline=None)
@given(data=st.data(), content=opt_texts, reasoning=opt_texts, refusal=opt_texts,
       calls=st.lists(tool, max_size=3), lp_content=opt_lps, lp_refusal=opt_lps,
       finish=st.sampled_from(["stop", "length", "tool_calls"]))
def test_chat_roundtrip(data: st.DataObject, content: str | None, reasoning: str | None,
                       refusal: str | None, calls: list[tuple[str, str, str]],
                       lp_content: list[Any] | None, lp_refusal: list[Any] | None, finish: str) -> None:
    indices = sorted(data.draw(st.lists(st.integers(0, 9), min_size=len(calls), max_size=len(calls),
                                        unique=True)))
    order = data.draw(st.permutations(range(len(calls))))  # stream order of calls differs from index order
    streams: dict[str, list[Any]] = {}
    for key, value in (("content", content), ("reasoning", reasoning), ("refusal", refusal)):
        if value is not None:
            streams[key] = [({key: piece}, None) for piece in split(data, value)]
    for k in order:
        streams[f"tool{k}"] = [({"tool_calls": [f]}, None)
                               for f in tool_fragments(data, indices[k], calls[k])]
    for key, lp in (("content", lp_content), ("refusal", lp_refusal)):
        if lp is not None:
            streams[f"lp_{key}"] = [({}, {key: piece}) for piece in split(data, lp)]
    events = interleave(data, streams)

    asm = Assembler("chat", return_token_ids=True)
    asm.feed({**META, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]})
    sent_ids: list[int] = []
    for n, (delta, logprobs) in enumerate(events):
        tok = data.draw(ids) if delta else []
        sent_ids.extend(tok)
        chunk = {**META, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish if n == len(events) - 1 else None,
                                      "token_ids": tok}]}
        assert check_token_ids(chunk, "chat") == len(tok)
        asm.feed(chunk)
    if not events:
        asm.feed({**META, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    asm.feed({**META, "choices": [], "usage": None})

    choice = asm.result()["choices"][0]
    message = choice["message"]
    assert message["content"] == content
    assert message["reasoning"] == reasoning
    assert message["refusal"] == refusal
    expected_calls = [{"id": calls[k][0], "type": "function",
                       "function": {"name": calls[k][1], "arguments": calls[k][2]}}
                      for k in range(len(calls))]
    assert message.get("tool_calls", []) == expected_calls
    if lp_content is None and lp_refusal is None:
        assert choice["logprobs"] is None
    else:
        expected_lp: dict[str, Any] = {"content": lp_content}
        if lp_refusal is not None:
            expected_lp["refusal"] = lp_refusal
        assert choice["logprobs"] == expected_lp
    assert choice["finish_reason"] == finish
    assert choice["token_ids"] == (sent_ids if events else None)
    assert asm.output_tokens == len(sent_ids)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), text=texts,
       entries=st.lists(st.tuples(st.text(max_size=4), st.none() | st.floats(-50, 0),
                                  st.integers(0, 500),
                                  st.none() | st.dictionaries(st.text(max_size=3), st.floats(-50, 0),
                                                              max_size=2)), max_size=6))
def test_completion_roundtrip(data: st.DataObject, text: str,
                              entries: list[tuple[str, float | None, int, dict[str, float] | None]]) -> None:
    slices = split(data, entries)
    streams: dict[str, list[Any]] = {
        "text": [{"text": piece} for piece in split(data, text)],
        "lp": [{"text": "", "logprobs": {"tokens": [e[0] for e in s], "token_logprobs": [e[1] for e in s],
                                         "text_offset": [e[2] for e in s],
                                         "top_logprobs": [e[3] for e in s]}} for s in slices],
    }
    asm = Assembler("completion", return_token_ids=False)
    for n, fields in enumerate(interleave(data, streams)):
        asm.feed({"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "finish_reason": None, "stop_reason": None, **fields}]})
    asm.feed({"id": "cmpl-p", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    out = asm.result(prompt_tokens=2)
    choice = out["choices"][0]
    assert choice["text"] == text
    assert choice["logprobs"] == {"tokens": [e[0] for e in entries],
                                  "token_logprobs": [e[1] for e in entries],
                                  "text_offset": [e[2] for e in entries],
                                  "top_logprobs": [e[3] for e in entries]}
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None  # (not asked: null, as vLLM answers)
    assert out["usage"]["prompt_tokens"] == 2
