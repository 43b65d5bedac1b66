"""Fuzz: the request parser and validator (``protocol/requests.py``), issue 13.

Property, for any bytes, any JSON-ish text, any JSON value and any mutation of a valid body, on both
routes: ``parse_request`` either returns a :class:`ParsedRequest` or raises :class:`InvalidRequest`
(a 4xx whose ``ErrorInfo`` renders the OpenAI envelope as strict JSON, ``param`` naming a field of
the body when it names one) — never another exception.  A ``ParsedRequest`` is what crosses the Ray
hop and becomes every engine leg's body, so it must be strict JSON (no NaN/Infinity) in valid UTF-8
(no lone surrogates), pickle round-trip, and build the engine request of every dialect.

Settings: see ``tests/fuzz/strategies.py`` (derandomized, no example database, bounded counts).
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.openai import OPENAI
from narwhal_serve.engines.sglang import SGLANG
from narwhal_serve.engines.vllm import VLLM
from narwhal_serve.errors import InvalidRequest
from narwhal_serve.protocol.requests import ParsedRequest, Route, parse_request
from narwhal_serve.protocol.strictjson import MAX_NESTING
from tests.fuzz.strategies import (
    ANY_TEXT,
    FINITE_FLOAT,
    UNICODE_TEXT,
    assert_envelope,
    assert_strict_json,
    encode,
    examples,
    json_text,
    json_values,
    mutated_bytes,
)

MODEL = "narwhal-sim"
ROUTES: tuple[Route, ...] = ("chat", "completion")
REQUIRED = ("model", "messages", "prompt")
PREFILL = EngineConfig(name="p", url="http://p:1", role="prefill", dialect="sglang")


def check(route: Route, raw: bytes) -> ParsedRequest | None:
    """Parse ``raw``; assert the property; return the request when it was accepted."""
    try:
        req = parse_request(route, raw, model=MODEL)
    except InvalidRequest as exc:
        info = exc.info()
        assert 400 <= info.status < 500, info
        body = info.body()
        assert_envelope(body)
        assert_strict_json(body)  # a message or param quoting the body must still render
        for k, v in info.headers().items():
            k.encode("latin-1"), v.encode("latin-1")
        if info.param is not None:
            _param_names_a_field(raw, info.param)
        return None
    _check_parsed(req)
    return req


def _param_names_a_field(raw: bytes, param: str) -> None:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return
    if not isinstance(body, dict) or "?" in param:  # '?': a key that is not valid Unicode, replaced
        return
    named = [*body, *REQUIRED]  # a missing required field is named too
    assert any(param == k or param.startswith(f"{k}.") for k in named), (param, list(body)[:10])


def _check_parsed(req: ParsedRequest) -> None:
    assert isinstance(req.body, dict)
    assert_strict_json(req.body)
    assert pickle.loads(pickle.dumps(req)) == req  # it crosses a Ray hop
    assert isinstance(req.stream, bool) and isinstance(req.include_usage, bool)
    assert isinstance(req.return_token_ids, bool)
    assert isinstance(req.prompt_tokens, int) and req.prompt_tokens >= 0
    assert req.max_output_tokens is None or (isinstance(req.max_output_tokens, int) and req.max_output_tokens >= 1)
    if req.prompt_token_ids is not None:
        assert all(isinstance(t, int) and t >= 0 for t in req.prompt_token_ids)
    boot = SGLANG.bootstrap_fields(PREFILL)
    for leg in (VLLM.decode_body(req), VLLM.prefill_body(req), VLLM.decode_body(req, {"k": [1, "x"]}),
                SGLANG.decode_body(req, boot), SGLANG.prefill_body(req, boot), OPENAI.decode_body(req)):
        httpx.Request("POST", "http://engine:8000/v1/completions", json=leg)  # exactly the engine call's encoding


# ---------------------------------------------------------------- valid bodies

text_parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text"]), "text": UNICODE_TEXT})
media_parts = st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio"]),
                                     "image_url": st.fixed_dictionaries({"url": UNICODE_TEXT})})
contents = st.none() | UNICODE_TEXT | st.lists(text_parts | media_parts, max_size=3)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | UNICODE_TEXT,
                                           "content": contents}), min_size=1, max_size=3)
token_ids = st.lists(st.integers(0, 2**40), min_size=1, max_size=6)
prompts = (UNICODE_TEXT.filter(bool) | st.lists(UNICODE_TEXT, min_size=1, max_size=1) | token_ids  # ("" is refused, as at vLLM)
           | st.lists(token_ids, min_size=1, max_size=1))
common = {
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 2**62),
    "min_tokens": st.integers(0, 64),
    "temperature": FINITE_FLOAT,
    "top_p": FINITE_FLOAT,
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": UNICODE_TEXT | st.lists(UNICODE_TEXT, max_size=3),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.just(1),
    "best_of": st.just(1),
    "return_token_ids": st.booleans(),
    "ignore_eos": st.booleans(),
    "user": UNICODE_TEXT,
    "extra": json_values(strict=True),
}
chat_bodies = st.fixed_dictionaries({"model": st.just(MODEL), "messages": messages}, optional={
    **common, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
    "max_completion_tokens": st.integers(1, 2**40), "modalities": st.just(["text"]),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                             "function": st.fixed_dictionaries({"name": UNICODE_TEXT})}), max_size=2),
})
completion_bodies = st.fixed_dictionaries({"model": st.just(MODEL), "prompt": prompts}, optional={
    **common, "logprobs": st.integers(0, 20), "echo": st.just(False),
})


def streamed_if_options(body: dict[str, Any]) -> dict[str, Any]:
    """``stream_options`` (not empty) only with ``stream: true``: without, it is refused."""
    return {**body, "stream": True} if body.get("stream_options") and not body.get("stream") else body


def valid_bodies() -> st.SearchStrategy[tuple[Route, dict[str, Any]]]:
    routes: tuple[Route, Route] = ("chat", "completion")
    return (st.tuples(st.just(routes[0]), chat_bodies.map(streamed_if_options))
            | st.tuples(st.just(routes[1]), completion_bodies.map(streamed_if_options)))


@examples(150)
@given(valid_bodies(), st.booleans(), st.booleans())
def test_valid_bodies_are_accepted(rb: tuple[Route, dict[str, Any]], ascii_: bool, pretty: bool) -> None:
    """No false refusals: every valid body parses, whatever its unicode and spacing."""
    route, body = rb
    raw = json.dumps(body, ensure_ascii=ascii_, indent=2 if pretty else None).encode()
    req = check(route, raw)
    assert req is not None, raw[:300]
    assert req.body == body


# ---------------------------------------------------------------- hostile input

@examples(150)
@given(st.sampled_from(ROUTES), st.binary(max_size=200))
def test_any_bytes(route: Route, raw: bytes) -> None:
    check(route, raw)


@examples(200)
@given(st.sampled_from(ROUTES), json_text())
def test_json_ish_text(route: Route, text: str) -> None:
    check(route, encode(text))


@examples(200)
@given(st.sampled_from(ROUTES), json_values(strict=False, max_leaves=20), st.booleans())
def test_any_json_value(route: Route, value: Any, ascii_: bool) -> None:
    """Non-finite floats, huge ints, lone surrogates (escaped, or raw bytes when not ``ascii_``)."""
    raw = encode(json.dumps(value, ensure_ascii=ascii_))
    check(route, raw)
    if not isinstance(value, dict):
        check(route, encode(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": value}],
                                        "prompt": value, "x": value}, ensure_ascii=ascii_)))


FIELDS = ["model", "messages", "prompt", "stream", "max_tokens", "min_tokens", "temperature", "top_p", "seed",
          "stop", "stream_options", "n", "best_of", "return_token_ids", "logprobs", "top_logprobs", "echo",
          "max_completion_tokens", "tools", "modalities", "audio", "ignore_eos"]


@st.composite
def mutated_body(draw: st.DrawFn) -> tuple[Route, bytes]:
    """A valid body with fields replaced by hostile values (deep inside too), then maybe byte-mutated."""
    route, body = draw(valid_bodies())
    hostile = json_values(strict=False)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(FIELDS) | ANY_TEXT)
        op = draw(st.integers(0, 3))
        if op == 0:
            body.pop(key, None)
        elif op == 1:
            body[key] = draw(hostile)
        elif op == 2 and isinstance(body.get("messages"), list) and body["messages"]:
            msg = body["messages"][0]
            if isinstance(msg, dict):
                msg[draw(st.sampled_from(["role", "content", "tool_calls", "name"]))] = draw(hostile)
        elif op == 3:
            body["stream_options"] = {draw(st.just("include_usage") | ANY_TEXT): draw(hostile)}
    raw = encode(json.dumps(body, ensure_ascii=draw(st.booleans())))
    if draw(st.booleans()):
        raw = draw(mutated_bytes(raw))
    return route, raw


@examples(300)
@given(mutated_body())
def test_mutated_valid_bodies(rb: tuple[Route, bytes]) -> None:
    check(*rb)


@examples(60)
@given(st.sampled_from(ROUTES), st.sampled_from(["[", "{\"a\":", "[{\"b\":"]),
       st.sampled_from([MAX_NESTING - 2, MAX_NESTING - 1, MAX_NESTING, MAX_NESTING + 1, 500, 990, 1100, 50_000]),
       st.booleans())
def test_deep_nesting(route: Route, opener: str, depth: int, inside_valid_body: bool) -> None:
    closer = "".join({"[": "]", "{": "}"}[c] for c in opener if c in "[{")[::-1]
    nested = opener * depth + "1" + closer * depth
    if inside_valid_body:
        text = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "prompt": "p", "x": {nested}}}'
    else:
        text = nested
    req = check(route, text.encode())
    if depth >= MAX_NESTING:
        assert req is None


@examples(100)
@given(st.sampled_from(ROUTES), st.sampled_from(["\ud800", "\udfff", "a\udc00b", "\ud83d", "\ude00x"]),
       st.sampled_from(["model", "content", "role", "key", "stop", "extra", "prompt"]),
       st.sampled_from(["escaped", "utf-8", "utf-16-le", "utf-16-be", "utf-16", "utf-32"]))
def test_lone_surrogates_never_pass(route: Route, bad: str, where: str, how: str) -> None:
    """Escaped (``\\ud800``) or raw (UTF-8 bytes ``ED A0 80``, or in a UTF-16/32 body, which json
    detects), in a value or a key: refused, 400."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    if where == "model":
        body["model"] = bad
    elif where == "content":
        body["messages"][0]["content"] = bad
        body["prompt"] = bad
    elif where == "role":
        body["messages"][0]["role"] = bad
    elif where == "key":
        body[bad] = 1
    elif where == "prompt":
        body["prompt"] = [bad]
    else:
        body[where] = [bad]
    text = json.dumps(body, ensure_ascii=how == "escaped")
    raw = encode(text) if how in ("escaped", "utf-8") else text.encode(how, "surrogatepass")
    assert check(route, raw) is None
