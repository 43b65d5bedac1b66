"""Fuzz: the hostile side of non-streaming assembly and the token-ID checks (issue 13).

``test_assembly_property.py`` shows that valid streams assemble back to their response; here the
engine misbehaves.  Streams of plausible vLLM chunks (content, reasoning, tool calls, legacy function
calls, logprobs, usage, token IDs) with any field anywhere replaced by something else (wrong types,
missing fields, huge ints, floats where ints belong, unicode, non-finite floats) or removed.

Property: :meth:`Assembler.feed` / :meth:`Assembler.result`, ``check_token_ids``,
``check_prompt_token_ids`` and ``expose`` either work or raise :class:`BadEngineResponse` (502, the
OpenAI envelope, ``param`` a path) — never another exception; an assembled result is JSON, and
strict JSON in UTF-8 whenever the chunks were (what the engine client lets through, see
``engines/client.py`` ``loads_strict``).

Settings: see ``tests/fuzz/strategies.py`` (derandomized, no example database, bounded counts).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from narwhal_serve.assembly.exposure import TRANSFER_KEYS, expose
from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.assembly.tokens import check_prompt_token_ids, check_token_ids
from narwhal_serve.errors import BadEngineResponse
from tests.fuzz.strategies import (
    ANY_FLOAT,
    ANY_INT,
    ANY_TEXT,
    FINITE_FLOAT,
    HUGE_INTS,
    UNICODE_TEXT,
    assert_envelope,
    assert_strict_json,
    examples,
    json_values,
)

Route = str
ids = st.lists(st.integers(0, 300_000), max_size=3)
finish = st.none() | st.sampled_from(["stop", "length", "tool_calls", "abort"])
stop_reason = st.none() | st.integers(0, 100) | UNICODE_TEXT
fn = st.fixed_dictionaries({}, optional={"name": UNICODE_TEXT, "arguments": UNICODE_TEXT})
tool_frag = st.fixed_dictionaries({"index": st.integers(0, 2)}, optional={
    "id": UNICODE_TEXT, "type": st.just("function"), "function": fn})
chat_lp_entry = st.fixed_dictionaries({"token": UNICODE_TEXT, "logprob": FINITE_FLOAT,
                                       "bytes": st.lists(st.integers(0, 255), max_size=3)},
                                      optional={"top_logprobs": st.just([])})
delta = st.fixed_dictionaries({}, optional={
    "role": st.just("assistant"), "content": UNICODE_TEXT, "reasoning": UNICODE_TEXT,
    "reasoning_content": UNICODE_TEXT, "refusal": UNICODE_TEXT, "tool_calls": st.lists(tool_frag, max_size=2),
    "function_call": fn,
})
chat_choice = st.fixed_dictionaries({"index": st.integers(0, 2), "delta": delta}, optional={
    "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids,
    "logprobs": st.none() | st.fixed_dictionaries({}, optional={"content": st.lists(chat_lp_entry, max_size=2)}),
})
cmpl_lp = st.fixed_dictionaries({}, optional={
    "tokens": st.lists(UNICODE_TEXT, max_size=2), "token_logprobs": st.lists(st.none() | FINITE_FLOAT, max_size=2),
    "text_offset": st.lists(st.integers(0, 99), max_size=2),
    "top_logprobs": st.lists(st.none() | st.dictionaries(UNICODE_TEXT, FINITE_FLOAT, max_size=2), max_size=2)})
cmpl_choice = st.fixed_dictionaries({"index": st.integers(0, 2), "text": UNICODE_TEXT}, optional={
    "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids, "prompt_token_ids": ids,
    "logprobs": st.none() | cmpl_lp, "prompt_logprobs": st.none() | st.just([None])})
usage = st.fixed_dictionaries({"prompt_tokens": st.integers(0, 99), "completion_tokens": st.integers(0, 99),
                               "total_tokens": st.integers(0, 200)},
                              optional={"prompt_tokens_details": st.none() | st.just({"cached_tokens": 0})})
meta = {"id": UNICODE_TEXT, "created": st.integers(0, 2**40), "model": UNICODE_TEXT}
meta_opt = {"system_fingerprint": st.none() | UNICODE_TEXT, "service_tier": st.none() | UNICODE_TEXT,
            "prompt_token_ids": st.none() | ids, "usage": st.none() | usage, "metrics": json_values(strict=True),
            "kv_transfer_params": json_values(strict=True)}


def chunks_of(route: Route) -> st.SearchStrategy[dict[str, Any]]:
    choice = chat_choice if route == "chat" else cmpl_choice
    return st.fixed_dictionaries({**meta, "choices": st.lists(choice, max_size=2)}, optional=meta_opt)


CHUNKS = {r: chunks_of(r) for r in ("chat", "completion")}
KEY_NAMES = st.sampled_from(["choices", "index", "delta", "content", "text", "token_ids", "prompt_token_ids", "role",
                        "finish_reason", "stop_reason", "logprobs", "tool_calls", "function_call", "function",
                        "name", "arguments", "id", "type", "usage", "prompt_tokens", "completion_tokens",
                        "total_tokens", "created", "model", "error", "audio", "annotations", "tokens",
                        "token_logprobs", "text_offset", "top_logprobs", "logprob", "token", "refusal",
                        "reasoning", "metrics", "service_tier", "system_fingerprint", "prompt_logprobs"])
KEYS = {True: KEY_NAMES | UNICODE_TEXT, False: KEY_NAMES | ANY_TEXT}


def hostile_values(strict: bool) -> st.SearchStrategy[Any]:
    base = json_values(strict=strict, max_leaves=6) | HUGE_INTS | ANY_INT | (FINITE_FLOAT if strict else ANY_FLOAT)
    odd = [1.0, 2.5, -1, True, False, "", [], {}, [1.0], [-1], [True], [None], [2**64], {"index": 0}, "x", 0]
    return base | st.sampled_from(odd) | (UNICODE_TEXT if strict else ANY_TEXT)


HOSTILE = {True: hostile_values(True), False: hostile_values(False)}


def _slots(obj: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key-or-index) inside ``obj``."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k))
            _slots(v, out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i))
            _slots(v, out)
    return out


@st.composite
def hostile_stream(draw: st.DrawFn, strict: bool) -> tuple[Route, list[Any]]:
    route = draw(st.sampled_from(["chat", "completion"]))
    # (copies: st.just and sampled_from hand out the same object every time; it is mutated here)
    chunks: list[Any] = copy.deepcopy(draw(st.lists(CHUNKS[route], min_size=1, max_size=5)))
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(chunks, [])
        container, key = draw(st.sampled_from(slots))
        op = draw(st.integers(0, 3))
        if op == 0 and isinstance(container, dict):
            del container[key]
        elif op == 1 and isinstance(container, dict):
            container[draw(KEYS[strict])] = copy.deepcopy(draw(HOSTILE[strict]))
        else:
            container[key] = copy.deepcopy(draw(HOSTILE[strict]))
    return route, chunks


def _is_502(exc: BadEngineResponse) -> None:
    info = exc.info()
    assert (info.status, info.code) == (502, "bad_engine_response")
    assert_envelope(info.body())
    assert info.param is None or isinstance(info.param, str)


def assemble(route: Route, chunks: list[Any], return_token_ids: bool, prompt_tokens: int | None) -> dict[str, Any] | None:
    asm = Assembler(route, return_token_ids=return_token_ids)  # type: ignore[arg-type]
    try:
        for chunk in chunks:
            asm.feed(chunk)
        result = asm.result(prompt_tokens=prompt_tokens)
    except BadEngineResponse as exc:
        _is_502(exc)
        return None
    assert isinstance(result, dict) and isinstance(result["choices"], list)
    assert isinstance(asm.output_tokens, int) and asm.output_tokens >= 0
    assert asm.finish_reason is None or isinstance(asm.finish_reason, str)
    assert isinstance(result["usage"], dict)
    json.dumps(result)
    return result


def token_checks(route: Route, chunk: Any) -> None:
    for check in (check_token_ids, check_prompt_token_ids):
        try:
            out = check(chunk, route)  # type: ignore[arg-type]
        except BadEngineResponse as exc:
            _is_502(exc)
            continue
        assert out is None or isinstance(out, (int, list))
        if isinstance(out, int):
            assert out >= 0


def exposure(chunk: Any, return_token_ids: bool) -> None:
    if not isinstance(chunk, dict):
        return
    seen = expose(copy.deepcopy(chunk), return_token_ids=return_token_ids)
    assert not any(k in seen for k in TRANSFER_KEYS)
    if not return_token_ids:
        assert seen.get("prompt_token_ids") is None


@examples(300)
@given(hostile_stream(strict=False), st.booleans(), st.none() | st.integers(0, 10**6))
def test_hostile_chunks_assemble_or_502(rc: tuple[Route, list[Any]], return_ids: bool, prompt_tokens: int | None) -> None:
    route, chunks = rc
    assemble(route, chunks, return_ids, prompt_tokens)
    for chunk in chunks:
        token_checks(route, chunk)
        exposure(chunk, return_ids)


@examples(300)
@given(hostile_stream(strict=True), st.booleans(), st.none() | st.integers(0, 10**6))
def test_strict_chunks_assemble_to_strict_json(rc: tuple[Route, list[Any]], return_ids: bool,
                                              prompt_tokens: int | None) -> None:
    """What the engine client lets through (strict JSON, valid UTF-8) assembles to strict JSON."""
    route, chunks = rc
    assert_strict_json(chunks)
    result = assemble(route, chunks, return_ids, prompt_tokens)
    if result is not None:
        assert_strict_json(result)
        if not return_ids:  # (null, as vLLM answers a client that did not ask)
            assert result.get("prompt_token_ids") is None
            assert all(c.get("token_ids") is None for c in result["choices"])


@examples(150)
@given(st.sampled_from(["chat", "completion"]), st.lists(json_values(strict=False, max_leaves=8), max_size=4),
       st.booleans())
def test_any_json_values_as_chunks(route: Route, chunks: list[Any], return_ids: bool) -> None:
    """Not even chunk-shaped: lists, strings, numbers, dicts of anything."""
    assemble(route, chunks, return_ids, None)
    for chunk in chunks:
        token_checks(route, chunk)
        exposure(chunk, return_ids)


@examples(60)
@given(st.sampled_from(["chat", "completion"]), st.sampled_from([1.0, 1e308, 2**63, 10**400, -0.0, True]),
       st.sampled_from(["index", "token_ids", "created", "prompt_tokens", "text_offset", "tool_index"]))
def test_floats_bools_and_huge_ints_where_ints_belong(route: Route, value: Any, field: str) -> None:
    choice: dict[str, Any] = ({"index": 0, "delta": {"content": "a"}} if route == "chat" else {"index": 0, "text": "a"})
    chunk: dict[str, Any] = {"id": "x", "created": 1, "model": "m", "choices": [choice]}
    if field == "index":
        choice["index"] = value
    elif field == "token_ids":
        choice["token_ids"] = [value]
    elif field == "created":
        chunk["created"] = value
    elif field == "prompt_tokens":
        chunk["usage"] = {"prompt_tokens": value, "completion_tokens": 1, "total_tokens": 2}
    elif field == "text_offset":
        choice["logprobs"] = {"text_offset": [value]} if route == "completion" else {"content": [{"logprob": value}]}
    else:
        choice["delta"] = {"tool_calls": [{"index": value, "id": "c", "function": {"name": "f"}}]}
        choice.pop("text", None)
    result = assemble(route, [chunk], True, None)
    if result is not None and isinstance(value, int) and not isinstance(value, bool) and value >= 2**63:
        assert_strict_json(result)  # a huge int is still JSON
    token_checks(route, chunk)
