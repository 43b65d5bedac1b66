"""Fuzz: engine answers — the SSE decoder, the engine client and the relay (issue 13).

* :class:`SSEDecoder`: any bytes under any split decode to the same events as in one piece, and
  SSE framed any way (CRLF, comments, other fields, multi-line data) gives back exactly its payloads.
* ``stream_chunks`` / ``post_json`` over ``httpx.MockTransport`` engines answering anything (any
  status, garbage, JSON that is not an object, error events, NaN, huge numbers, lone surrogates, deep
  nesting, no ``[DONE]``, a connection that breaks): every outcome is chunks or :class:`EngineFailure`,
  never another exception; chunks are JSON objects the router can pass on as strict JSON in UTF-8;
  a failure's upstream message and param (which a client may see) are valid Unicode.
* :class:`Relay` over such engines, streaming and not, on every dialect and P/D kind: it never
  raises and ends with exactly one ``final`` message; a stream's data is well-formed SSE of strict JSON
  objects ending with ``data: [DONE]``; a non-streaming answer is one strict JSON object; any error is
  an ``ErrorInfo`` with a 4xx/5xx status rendering the OpenAI envelope.

Settings: see ``tests/fuzz/strategies.py`` (derandomized, no example database, bounded counts).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.client import post_json, stream_chunks
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.engines.sse import SSEDecoder
from narwhal_serve.errors import ErrorInfo
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import Route, parse_request
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from tests.fuzz.strategies import (
    ANY_TEXT,
    HUGE_INTS,
    UNICODE_TEXT,
    assert_envelope,
    assert_strict_json,
    encode,
    examples,
    json_text,
    json_values,
    splits,
)

MODEL = "narwhal-sim"
ROUTE_NAMES: tuple[Route, ...] = ("chat", "completion")
Answer = Callable[[httpx.Request], httpx.Response]  # one engine's answer to one request

# ================================================================ SSE decoder


def decode_all(pieces: list[bytes]) -> list[bytes]:
    dec = SSEDecoder()
    out: list[bytes] = []
    for p in pieces:
        out += dec.feed(p)
    return out + dec.flush()


sse_ish = st.lists(st.sampled_from([b"data:", b"data: ", b"data", b":", b"\n", b"\r\n", b"\r", b"\n\n", b"event: x",
                                    b"id: 1", b" ", b"[DONE]", b'{"a":1}', b"\xff\xfe", b"\xed\xa0\x80"])
                   | st.binary(max_size=8), max_size=30).map(b"".join)


@examples(300)
@given(st.data(), sse_ish | st.binary(max_size=300))
def test_decoder_any_split_same_events(data: st.DataObject, raw: bytes) -> None:
    whole = decode_all([raw])
    assert decode_all(splits(data, raw, max_cuts=12)) == whole
    assert decode_all([raw[i : i + 1] for i in range(len(raw))]) == whole  # byte by byte
    assert all(isinstance(e, bytes) for e in whole)


payloads = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")) | st.sampled_from(
    [b"[DONE]", b"", b" leading space", b'{"x": "\xf0\x9f\x98\x80"}', b"data: nested"])


@examples(300)
@given(st.data(), st.lists(st.lists(payloads, min_size=1, max_size=3), max_size=8), st.sampled_from([b"\n", b"\r\n"]),
       st.booleans())
def test_decoder_round_trip(data: st.DataObject, events: list[list[bytes]], eol: bytes, terminate_last: bool) -> None:
    """Events of one or more ``data:`` lines, any framing noise between them: exactly the payloads."""
    noise = st.sampled_from([b"", b": keep-alive" + eol, b"event: chunk" + eol, b"id: 7" + eol, b"retry: 10" + eol,
                             eol, b":" + eol])
    raw = b""
    for i, lines in enumerate(events):
        raw += data.draw(noise)
        for line in lines:
            space = data.draw(st.sampled_from([b" ", b""]))  # the decoder drops one leading space
            raw += b"data:" + (space or (b" " if line.startswith(b" ") else b"")) + line + eol
            raw += data.draw(st.sampled_from([b"", b": c" + eol, b"event: e" + eol]))
        if i < len(events) - 1 or terminate_last:
            raw += eol
    assert decode_all(splits(data, raw, max_cuts=10)) == [b"\n".join(lines) for lines in events]


# ================================================================ engine answers

def chunk_strategy(route: str) -> st.SearchStrategy[dict[str, Any]]:
    """A plausible engine chunk (vLLM shape), often valid."""
    ids = st.lists(st.integers(0, 200_000), min_size=1, max_size=3)
    finish = st.none() | st.sampled_from(["stop", "length", "tool_calls"])
    if route == "chat":
        delta = st.fixed_dictionaries({}, optional={"role": st.just("assistant"), "content": UNICODE_TEXT,
                                                    "reasoning": UNICODE_TEXT})
        choice = st.fixed_dictionaries({"index": st.just(0), "delta": delta, "finish_reason": finish},
                                       optional={"token_ids": ids, "logprobs": st.none()})
    else:
        choice = st.fixed_dictionaries({"index": st.just(0), "text": UNICODE_TEXT, "finish_reason": finish},
                                       optional={"token_ids": ids, "prompt_token_ids": ids})
    usage = st.fixed_dictionaries({"prompt_tokens": st.integers(0, 99), "completion_tokens": st.integers(0, 99),
                                   "total_tokens": st.integers(0, 200)})
    meta = {"id": st.just("cmpl-x"), "object": st.just("chat.completion.chunk"), "created": st.just(1),
            "model": st.just("m")}
    return (st.fixed_dictionaries({**meta, "choices": st.lists(choice, min_size=1, max_size=1)})
            | st.fixed_dictionaries({**meta, "choices": st.just([]), "usage": usage}))


CHUNKS = {route: chunk_strategy(route) for route in ("chat", "completion")}

# Values an engine should never send, put anywhere in a chunk.
HOSTILE = (json_values(strict=False, max_leaves=6) | HUGE_INTS | st.sampled_from(
    [float("nan"), float("inf"), -float("inf"), "\ud800", 1.5, True, [], {}, [1.0], [-1], [True], "x"]))


@st.composite
def hostile_chunk(draw: st.DrawFn, route: str) -> dict[str, Any]:
    chunk = copy.deepcopy(draw(CHUNKS[route]))  # (st.just hands out one shared object)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.integers(0, 3))
        choices = chunk.get("choices")
        target: Any = chunk
        if where >= 1 and isinstance(choices, list) and choices and isinstance(choices[0], dict):
            target = choices[0]
            if where >= 2 and isinstance(target.get("delta"), dict):
                target = target["delta"]
        key = draw(st.sampled_from(["choices", "usage", "index", "delta", "content", "text", "token_ids",
                                    "finish_reason", "role", "logprobs", "tool_calls", "error", "model", "created",
                                    "prompt_token_ids", "kv_transfer_params", "stop_reason", "audio"]) | ANY_TEXT)
        target[key] = copy.deepcopy(draw(HOSTILE))
    return chunk


def dumps(value: Any, ascii_: bool) -> bytes:
    """What a sloppy engine sends: NaN and Infinity as literals, lone surrogates raw or escaped."""
    return encode(json.dumps(value, ensure_ascii=ascii_))


ERRORS = st.fixed_dictionaries({}, optional={
    "message": ANY_TEXT | HOSTILE, "type": ANY_TEXT, "param": ANY_TEXT | HOSTILE,
    "code": st.sampled_from([400, 413, 422, 429, 500, 503, 10**40, "400", True, None]) | HOSTILE})
PREFILL_ANSWERS = st.fixed_dictionaries({}, optional={"kv_transfer_params": json_values(strict=True)}).map(
    lambda d: json.dumps(d).encode())


@st.composite
def payload(draw: st.DrawFn, route: str) -> bytes:
    kind = draw(st.integers(0, 11))
    ascii_ = draw(st.booleans())
    if kind <= 4:
        return dumps(draw(CHUNKS[route]), ascii_)
    if kind <= 6:
        return dumps(draw(hostile_chunk(route)), ascii_)
    if kind == 7:
        return encode(draw(json_text()))
    if kind == 8:
        return draw(st.binary(max_size=20))
    if kind == 9:
        return dumps({"error": draw(ERRORS | HOSTILE)}, ascii_)
    if kind == 10:
        depth = draw(st.sampled_from([100, 129, 500, 950, 990, 1100, 20_000]))
        inner = b"[" * depth + b"1" + b"]" * depth
        return draw(st.sampled_from([inner, b'{"choices": ' + inner + b"}", b'{"choices": [{"index": 0, "delta": '
                                     + b'{"x":' * depth + b"1" + b"}" * depth + b"}]}"]))
    return draw(st.sampled_from([b'{"a": NaN}', b'{"choices": [], "usage": 1e999}', b'{"x": -Infinity}',
                                 b'{"x": "\\ud800"}', b'{"x": "\xed\xa0\x80"}', b'{"x": ' + b"9" * 400 + b".0}",
                                 b'{"created": ' + b"1" * 5000 + b"}", b'{\x00"\x00}\x00', b"[DONE] ", b"[DONE]"]))


@st.composite
def sse_body(draw: st.DrawFn, route: str) -> bytes:
    """An engine's SSE stream: events, framing noise, maybe ``[DONE]``, maybe cut short."""
    out = b""
    for _ in range(draw(st.integers(0, 6))):
        out += draw(st.sampled_from([b"", b"", b": ping\n\n", b"event: x\n", b"\r\n"]))
        out += b"data: " + draw(payload(route)) + draw(st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n\n", b"\n"]))
    if draw(st.integers(0, 3)) > 0:
        out += draw(st.sampled_from([b"data: [DONE]\n\n", b"data:[DONE]\r\n\r\n", b"data: [DONE]"]))
    if draw(st.integers(0, 9)) == 0:
        out = out[: draw(st.integers(0, len(out)))]
    return out


class Parts(httpx.AsyncByteStream):
    """A body in several network reads; ``fail`` breaks the connection after them."""

    def __init__(self, parts: list[bytes], fail: bool) -> None:
        self.parts = parts
        self.fail = fail

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for p in self.parts:
            if p:
                yield p
        if self.fail:
            raise httpx.ReadError("connection reset by fuzz")


@st.composite
def engine_answer(draw: st.DrawFn, route: str, streaming: bool) -> Answer:
    """One engine's answer to one request: a status, a body (SSE or JSON) in parts, maybe broken."""
    status = draw(st.sampled_from([200] * 8 + [400, 404, 413, 422, 429, 500, 503, 204, 302]))
    if streaming:
        body = draw(sse_body(route))
    else:
        body = draw(PREFILL_ANSWERS | payload(route))
    if status != 200 and draw(st.booleans()):
        body = dumps({"error": draw(ERRORS)}, draw(st.booleans()))
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=5)))
    parts = [body[x:y] for x, y in zip([0, *cuts], [*cuts, len(body)])]
    mode = draw(st.sampled_from(["ok"] * 8 + ["connect_error", "broken"]))

    def answer(req: httpx.Request) -> httpx.Response:
        if mode == "connect_error":
            raise httpx.ConnectError("refused by fuzz")
        return httpx.Response(status, stream=Parts(parts, mode == "broken"))

    return answer


def check_failure(exc: EngineFailure) -> None:
    assert isinstance(exc.message, str) and isinstance(str(exc), str)
    assert exc.status is None or isinstance(exc.status, int)
    for s in (exc.upstream_message, exc.param):  # the client may see these in a 400
        assert s is None or isinstance(s, str)
        if s is not None:
            s.encode("utf-8")


def check_chunk(chunk: Any) -> None:
    assert isinstance(chunk, dict)
    assert_strict_json(chunk)


async def _client_call(answer: Answer, streaming: bool) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        if streaming:
            out: list[dict[str, Any]] = []
            async for batch in stream_chunks(client, "e", "http://e/v1/chat/completions", {"a": 1}, {}):
                assert isinstance(batch, list) and batch
                out += batch
            return out
        return [await post_json(client, "e", "http://e/v1/chat/completions", {"a": 1}, {})]


@examples(400)
@given(st.sampled_from(["chat", "completion"]).flatmap(lambda r: engine_answer(r, True)))
async def test_stream_chunks_gives_chunks_or_engine_failure(answer: Answer) -> None:
    try:
        chunks = await _client_call(answer, True)
    except EngineFailure as exc:
        check_failure(exc)
        return
    for c in chunks:
        check_chunk(c)


@examples(250)
@given(st.sampled_from(["chat", "completion"]).flatmap(lambda r: engine_answer(r, False)))
async def test_post_json_gives_an_object_or_engine_failure(answer: Answer) -> None:
    try:
        (obj,) = await _client_call(answer, False)
    except EngineFailure as exc:
        check_failure(exc)
        return
    check_chunk(obj)


@examples(100)
@given(st.data(), st.lists(st.sampled_from(["chat", "completion"]).flatmap(chunk_strategy), max_size=5),
       st.booleans())
async def test_valid_streams_arrive_whole(data: st.DataObject, chunks: list[dict[str, Any]], crlf: bool) -> None:
    """No false failures: a valid stream under any split yields exactly its chunks."""
    eol = b"\r\n" if crlf else b"\n"
    body = b"".join(b"data: " + json.dumps(c, ensure_ascii=data.draw(st.booleans())).encode() + eol + eol
                    for c in chunks) + b"data: [DONE]" + eol + eol
    parts = splits(data, body)
    got = await _client_call(lambda r: httpx.Response(200, stream=Parts(parts, False)), True)
    assert got == chunks


# ================================================================ the relay

ENGINES = {
    "v": EngineConfig(name="v", url="http://v"),
    "o": EngineConfig(name="o", url="http://o", dialect="openai"),
    "vp": EngineConfig(name="vp", url="http://vp", role="prefill"),
    "vd": EngineConfig(name="vd", url="http://vd", role="decode"),
    "sp": EngineConfig(name="sp", url="http://sp", role="prefill", dialect="sglang"),
    "sd": EngineConfig(name="sd", url="http://sd", role="decode", dialect="sglang"),
}
ROUTES = {
    "v": RouteChoice(kind="single", decode=ENGINES["v"]),
    "o": RouteChoice(kind="single", decode=ENGINES["o"]),
    "vpd": RouteChoice(kind="pd", decode=ENGINES["vd"], prefill=ENGINES["vp"]),
    "spd": RouteChoice(kind="pd", decode=ENGINES["sd"], prefill=ENGINES["sp"]),
}


@st.composite
def relay_case(draw: st.DrawFn) -> tuple[PlacedRequest, dict[str, Answer]]:
    route: Route = draw(st.sampled_from(ROUTE_NAMES))
    stream = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "stream": stream}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    if stream and draw(st.booleans()):  # (without stream it is refused, as OpenAI and vLLM refuse it)
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.booleans()):
        body["return_token_ids"] = draw(st.booleans())
    req = parse_request(route, json.dumps(body).encode(), model=MODEL)
    names = draw(st.lists(st.sampled_from(sorted(ROUTES)), min_size=1, max_size=3))
    placed = PlacedRequest("rid-fuzz", MODEL, req, tuple(ROUTES[n] for n in names), time.time() + 60)
    answers = {}
    for host in sorted({e for n in names for e in ROUTES[n].engines}):
        prefill = host in ("vp", "sp")
        answers[host] = draw(engine_answer(route, streaming=not prefill))
    return placed, answers


def _sse_events(data: bytes) -> list[bytes]:
    assert data.endswith(b"\n\n"), data[-80:]
    events = data[:-2].split(b"\n\n")
    for e in events:
        assert e.startswith(b"data: "), e[:80]
    return [e[6:] for e in events]


def check_error(err: ErrorInfo) -> None:
    assert 400 <= err.status <= 599, err
    body = err.body()
    assert_envelope(body)
    assert_strict_json(body)
    for k, v in err.headers().items():
        k.encode("latin-1"), v.encode("latin-1")


def strict_loads(raw: bytes) -> Any:
    def no_constant(name: str) -> Any:
        raise AssertionError(f"{name} in the router's output")

    return json.loads(raw.decode("utf-8"), parse_constant=no_constant)


def check_relay(placed: PlacedRequest, msgs: list[RelayMessage]) -> None:
    assert msgs, "the relay ended without a message"
    assert [m.final for m in msgs].count(True) == 1 and msgs[-1].final, [m.final for m in msgs]
    last = msgs[-1]
    for m in msgs:
        if m.error is not None:
            check_error(m.error)
    assert all(m.error is None for m in msgs[:-1])
    data = b"".join(m.data for m in msgs)
    if last.error is not None and not last.data:  # refused before response headers
        assert not data
        return
    if placed.request.stream:
        events = _sse_events(data)
        assert events[-1] == b"[DONE]"
        assert b"[DONE]" not in events[:-1]
        objs = [strict_loads(e) for e in events[:-1]]
        assert all(isinstance(o, dict) for o in objs)
        if last.error is not None:  # failed after headers: one error event, then [DONE]
            assert objs and objs[-1] == last.error.body()
        else:
            assert all("error" not in o for o in objs)
            for o in objs:
                assert o.get("model") in (None, MODEL)
    else:
        assert len(msgs) >= 1 and last.data and last.error is None
        obj = strict_loads(last.data)
        assert isinstance(obj, dict) and isinstance(obj.get("choices"), list) and obj["model"] == MODEL
        assert "usage" in obj


@examples(400)
@given(relay_case())
async def test_relay_always_ends_properly(case: tuple[PlacedRequest, dict[str, Answer]]) -> None:
    placed, answers = case
    late: list[str] = []
    ended = False

    def handler(req: httpx.Request) -> httpx.Response:
        if ended:
            late.append(req.url.host)
        return answers[req.url.host](req)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        msgs = [m async for m in Relay(client, idle_timeout_s=30).run(placed)]
        ended = True
        for _ in range(3):  # a leg the relay left behind would go out now
            await asyncio.sleep(0)
    check_relay(placed, msgs)
    assert not late, f"engine legs sent after the relay ended: {late}"


async def test_no_sglang_prefill_leg_after_the_relay_ended() -> None:
    sp = EngineConfig(name="sp", url="http://sp", role="prefill", dialect="sglang")
    sd = EngineConfig(name="sd", url="http://sd", role="decode", dialect="sglang")
    ended, late = [False], []

    def handler(r: httpx.Request) -> httpx.Response:
        if ended[0]:
            late.append(r.url.host)
        if r.url.host == "sd":  # a decode chunk the assembler refuses (usage not an object)
            return httpx.Response(200, stream=httpx.ByteStream(b'data: {"choices": [], "usage": 1}\n\n'))
        return httpx.Response(200, stream=httpx.ByteStream(b"{}"))

    req = parse_request("chat", b'{"model": "m", "messages": [{"role": "user", "content": "q"}]}', model="m")
    placed = PlacedRequest("r", "m", req, (RouteChoice(kind="pd", decode=sd, prefill=sp),), time.time() + 30)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        msgs = [m async for m in Relay(client).run(placed)]
        ended[0] = True
        await asyncio.sleep(0.01)
    assert msgs[-1].error is not None and msgs[-1].error.code == "bad_engine_response"
    assert late == []
