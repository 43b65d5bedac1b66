"""The relay's attempt loop over httpx.MockTransport engines: retries before headers, client errors,
errors after headers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from narwhal_serve.config import EngineConfig
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from tests.support.relay import faults_of

E1 = EngineConfig(name="e1", url="http://e1")
E2 = EngineConfig(name="e2", url="http://e2")


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def tok(text: str, ids: Any, finish: str | None = None) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish, "token_ids": ids}]}


ROLE = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
GOOD = sse(ROLE, tok("a", [1]), tok("b", [2], "length"))


def placed(stream: bool, body: dict[str, Any] | None = None) -> PlacedRequest:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": stream, **(body or {})})
    req = parse_request("chat", raw.encode(), model="m")
    routes = (RouteChoice(kind="single", decode=E1), RouteChoice(kind="single", decode=E2))
    return PlacedRequest("rid-1", "m", req, routes, time.time() + 30)


async def run(handler: Callable[[httpx.Request], httpx.Response], p: PlacedRequest) -> tuple[list[RelayMessage], list[str]]:
    seen: list[str] = []

    def h(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.host)
        assert req.headers["x-request-id"] == "rid-1"
        return handler(req)

    async with httpx.AsyncClient(transport=httpx.MockTransport(h)) as client:
        msgs = [m async for m in Relay(client).run(p)]
    return msgs, seen


async def test_engine_client_error_is_a_400_without_retry() -> None:
    err = {"error": {"message": "max_tokens too big", "type": "BadRequestError", "param": "max_tokens", "code": 400}}
    msgs, seen = await run(lambda r: httpx.Response(400, json=err), placed(False))
    assert seen == ["e1"]
    assert msgs[-1].error is not None and msgs[-1].error.status == 400
    assert msgs[-1].error.param == "max_tokens" and "max_tokens too big" in msgs[-1].error.message


async def test_server_error_retries_next_route() -> None:
    def h(r: httpx.Request) -> httpx.Response:
        if r.url.host == "e1":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return httpx.Response(200, stream=httpx.ByteStream(GOOD))

    msgs, seen = await run(h, placed(True))
    assert seen == ["e1", "e2"]
    data = b"".join(m.data for m in msgs)
    assert data.endswith(b"data: [DONE]\n\n") and b'"a"' in data and msgs[-1].error is None
    assert msgs[0].first_token and msgs[-1].stats is not None and msgs[-1].stats.attempts == 2


async def test_bad_first_token_ids_retry_then_all_bad_is_502() -> None:
    bad = sse(ROLE, tok("a", [True]))
    msgs, seen = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(bad)), placed(True))
    assert seen == ["e1", "e2"]
    assert len(msgs) == 1 and msgs[0].error is not None and msgs[0].error.status == 502 and not msgs[0].data


class Parts(httpx.AsyncByteStream):
    """A body that arrives in several network reads, a moment apart (so the relay has sent one
    read on before the next arrives, rather than coalescing them)."""

    def __init__(self, *parts: bytes) -> None:
        self.parts = parts

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for i, p in enumerate(self.parts):
            if i:
                await asyncio.sleep(0.05)
            yield p


async def test_failure_after_headers_is_an_error_event() -> None:
    parts = (sse(ROLE, tok("a", [1]), done=False), sse(tok("b", [-5]), done=False))
    msgs, seen = await run(lambda r: httpx.Response(200, stream=Parts(*parts)), placed(True))
    assert seen == ["e1"]
    tail = msgs[-1]
    assert tail.final and tail.error is not None and tail.error.code == "bad_engine_response"
    assert tail.data.startswith(b'data: {"error"') and tail.data.endswith(b"data: [DONE]\n\n")


async def test_stream_without_done_is_a_failure_and_usage_is_hidden_unless_asked() -> None:
    usage = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(sse(ROLE, tok("a", [1], "stop"), usage))), placed(True))
    data = b"".join(m.data for m in msgs)
    assert b'"usage"' not in data and b"[1]" not in data and b'"token_ids":null' in data  # (vLLM's shape: null)
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(sse(ROLE, tok("a", [1], "stop"), usage))),
                        placed(True, {"stream_options": {"include_usage": True}, "return_token_ids": True}))
    data = b"".join(m.data for m in msgs)
    assert b'"usage"' in data and b'"token_ids":[1]' in data


class Stalls(httpx.AsyncByteStream):
    """``head`` at once, then silence until closed."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        self.closed = asyncio.Event()

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield self.head
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.set()


async def _relay(handler: Callable[[httpx.Request], httpx.Response], p: PlacedRequest, idle_s: float) -> list[RelayMessage]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return [m async for m in Relay(client, idle_timeout_s=idle_s).run(p)]


async def test_an_engine_silent_before_the_first_token_fails_over() -> None:
    stalls = Stalls(sse(ROLE, done=False))

    def h(r: httpx.Request) -> httpx.Response:
        if r.url.host == "e1":
            return httpx.Response(200, stream=stalls)
        return httpx.Response(200, stream=httpx.ByteStream(GOOD))

    t0 = time.monotonic()
    msgs = await _relay(h, placed(True), idle_s=0.2)
    assert time.monotonic() - t0 < 5
    assert msgs[-1].error is None and msgs[-1].stats is not None and msgs[-1].stats.engines == ("e2",)
    assert stalls.closed.is_set()


async def test_an_engine_silent_after_the_first_token_ends_with_an_error_event() -> None:
    stalls = Stalls(sse(ROLE, tok("a", [1]), done=False))
    msgs = await _relay(lambda r: httpx.Response(200, stream=stalls), placed(True), idle_s=0.2)
    tail = msgs[-1]
    assert tail.final and tail.error is not None and tail.error.code == "bad_engine_response"
    assert b"silent" in tail.data and tail.data.endswith(b"data: [DONE]\n\n")
    assert stalls.closed.is_set()


async def test_the_deadline_holds_after_headers() -> None:
    p = placed(True)
    p = PlacedRequest(p.request_id, p.model, p.request, p.candidates, time.time() + 0.3)
    stalls = Stalls(sse(ROLE, tok("a", [1]), done=False))
    t0 = time.monotonic()
    msgs = await _relay(lambda r: httpx.Response(200, stream=stalls), p, idle_s=60)
    assert time.monotonic() - t0 < 5
    tail = msgs[-1]
    assert tail.error is not None and tail.error.code == "deadline_expired" and tail.error.status == 504
    assert tail.data.endswith(b"data: [DONE]\n\n")


async def test_a_stream_cut_by_an_error_still_counts_its_tokens_for_a_client_that_asked_for_usage() -> None:
    """contract.md: a stream that asked for ``stream_options.include_usage`` gets a usage chunk
    before ``[DONE]`` even when the engine sent none, an error event's stream too (a client that
    bills from it is owed the tokens it got)."""
    p = placed(True, {"stream_options": {"include_usage": True}})
    p = PlacedRequest(p.request_id, p.model, p.request, p.candidates, time.time() + 0.3)
    stalls = Stalls(sse(ROLE, tok("a", [1]), tok("b", [2]), done=False))
    msgs = await _relay(lambda r: httpx.Response(200, stream=stalls), p, idle_s=60)
    tail = msgs[-1]
    assert tail.error is not None and tail.error.code == "deadline_expired"
    usage = [json.loads(line[6:]) for line in tail.data.split(b"\n") if line.startswith(b"data: {") and b'"usage"' in line]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 2 and usage[0]["choices"] == []
    assert tail.data.index(b'"usage"') < tail.data.index(b'"error"') and tail.data.endswith(b"data: [DONE]\n\n")
    msgs = await _relay(lambda r: httpx.Response(200, stream=Stalls(sse(ROLE, tok("a", [1]), done=False))),
                        PlacedRequest(p.request_id, p.model, placed(True).request, p.candidates, time.time() + 0.3), idle_s=60)
    assert b'"usage"' not in b"".join(m.data for m in msgs)  # not asked: none


async def test_a_non_streaming_request_past_its_deadline_is_a_504() -> None:
    p = placed(False)
    p = PlacedRequest(p.request_id, p.model, p.request, p.candidates, time.time() + 0.3)
    msgs = await _relay(lambda r: httpx.Response(200, stream=Stalls(sse(ROLE, done=False))), p, idle_s=60)
    assert len(msgs) == 1 and msgs[0].error is not None and msgs[0].error.code == "deadline_expired"


async def test_a_stream_that_asked_for_usage_gets_it_computed_when_the_engine_omits_it() -> None:
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(GOOD)),
                        placed(True, {"stream_options": {"include_usage": True}}))
    events = [e for e in b"".join(m.data for m in msgs).split(b"\n\n") if e.startswith(b"data: {")]
    last = json.loads(events[-1][6:])
    assert last["choices"] == [] and last["model"] == "m" and last["id"] == "x"
    assert last["usage"]["completion_tokens"] == 2 and last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 2
    # an engine that sent usage keeps its own, once
    usage = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(sse(ROLE, tok("a", [1]), tok("b", [2], "stop"), usage))),
                        placed(True, {"stream_options": {"include_usage": True}}))
    data = b"".join(m.data for m in msgs)
    assert data.count(b'"usage"') == 1 and b'"prompt_tokens": 7' in data.replace(b":7", b": 7")


def _with(p: PlacedRequest, **kw: Any) -> PlacedRequest:
    from dataclasses import replace

    return replace(p, **kw)


async def test_no_first_token_within_the_limit_fails_over_and_blames_the_engine() -> None:
    stalls = Stalls(sse(ROLE, done=False))  # headers and a role chunk, then silence

    def h(r: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=stalls if r.url.host == "e1" else httpx.ByteStream(GOOD))

    t0 = time.monotonic()
    msgs = await _relay(h, _with(placed(True), first_token_s=0.2), idle_s=60)  # the idle limit alone: 60 s
    assert time.monotonic() - t0 < 5
    assert msgs[-1].error is None and msgs[-1].stats is not None and msgs[-1].stats.engines == ("e2",)
    faults = [f for m in msgs for f in faults_of(m)]
    assert [(f.engine, f.kind) for f in faults] == [("e1", "timeout")]
    assert faults_of(msgs[0]) and msgs[0].first_token  # sent with the first message, not at the end


async def test_the_last_route_waits_past_the_first_token_limit_for_its_deadline() -> None:
    p = placed(True)
    p = PlacedRequest(p.request_id, p.model, p.request, p.candidates[:1], time.time() + 0.6, first_token_s=0.1)
    msgs = await _relay(lambda r: httpx.Response(200, stream=Stalls(sse(ROLE, done=False))), p, idle_s=60)
    assert len(msgs) == 1 and msgs[0].error is not None and msgs[0].error.code == "deadline_expired"
    assert [(f.engine, f.kind) for f in faults_of(msgs[0])] == [("e1", "timeout")]


async def test_engine_backpressure_moves_on_and_is_reported_as_such_with_retry_after() -> None:
    def h(r: httpx.Request) -> httpx.Response:
        if r.url.host == "e1":
            return httpx.Response(429, json={"error": {"message": "busy"}}, headers={"Retry-After": "3"})
        return httpx.Response(200, stream=httpx.ByteStream(GOOD))

    msgs, seen = await run(h, placed(False))
    assert seen == ["e1", "e2"] and msgs[-1].error is None
    (f,) = [f for m in msgs for f in faults_of(m)]
    assert (f.engine, f.kind, f.retry_after_s) == ("e1", "backpressure", 3.0)


async def test_backpressure_on_every_route_is_a_503_with_the_soonest_retry_after() -> None:
    def h(r: httpx.Request) -> httpx.Response:
        after = {"e1": "7", "e2": "2.5"}[r.url.host]
        return httpx.Response(429 if r.url.host == "e1" else 503, json={"error": {"message": "busy"}},
                              headers={"Retry-After": after})

    msgs, seen = await run(h, placed(False))
    assert seen == ["e1", "e2"]
    err = msgs[-1].error
    assert err is not None and (err.status, err.code, err.retry_after, err.reason) == (
        503, "backend_unavailable", 3, "engine_backpressure")
    assert [f.kind for f in faults_of(msgs[-1])] == ["backpressure", "backpressure"]

    def mixed(r: httpx.Request) -> httpx.Response:  # one busy, one broken: a failure, as before
        if r.url.host == "e1":
            return httpx.Response(429, json={"error": {"message": "busy"}})
        return httpx.Response(500, json={"error": {"message": "boom"}})

    msgs, _ = await run(mixed, placed(False))
    assert msgs[-1].error is not None and msgs[-1].error.code == "bad_engine_response"


async def test_a_failed_prefill_leg_is_blamed_on_the_prefill_engine() -> None:
    pre, dec = EngineConfig(name="p1", url="http://p1", role="prefill"), EngineConfig(name="d1", url="http://d1", role="decode")

    def h(r: httpx.Request) -> httpx.Response:
        if r.url.host == "p1":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return httpx.Response(200, stream=httpx.ByteStream(GOOD))

    p = placed(True)
    p = _with(p, candidates=(RouteChoice(kind="pd", decode=dec, prefill=pre), RouteChoice(kind="single", decode=E2)))
    msgs, seen = await run(h, p)
    assert seen == ["p1", "e2"] and msgs[-1].error is None
    assert [(f.engine, f.kind) for m in msgs for f in faults_of(m)] == [("p1", "error")]
    # silent prefill: the timeout is the prefill engine's too
    stalls = Stalls(b"")

    def h2(r: httpx.Request) -> httpx.Response:
        if r.url.host == "p1":
            return httpx.Response(200, stream=stalls)
        return httpx.Response(200, stream=httpx.ByteStream(GOOD))

    msgs = await _relay(h2, _with(p, first_token_s=0.2), idle_s=60)
    assert msgs[-1].error is None and [(f.engine, f.kind) for m in msgs for f in faults_of(m)] == [("p1", "timeout")]


async def test_a_stream_broken_after_headers_reports_its_engine() -> None:
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(sse(ROLE, tok("a", [1]), done=False))),
                        placed(True))
    assert msgs[-1].error is not None and [(f.engine, f.kind) for f in faults_of(msgs[-1])] == [("e1", "error")]
    # a client error (400) is the request's fault, not the engine's
    err = {"error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": 400}}
    msgs, _ = await run(lambda r: httpx.Response(400, json=err), placed(True))
    assert msgs[-1].error is not None and msgs[-1].error.status == 400 and not faults_of(msgs[-1])


async def test_the_router_epoch_goes_to_the_engine() -> None:
    seen: list[str | None] = []

    def h(r: httpx.Request) -> httpx.Response:
        seen.append(r.headers.get("x-narwhal-epoch"))
        return httpx.Response(200, stream=httpx.ByteStream(GOOD))

    await _relay(h, _with(placed(True), epoch=42), idle_s=60)
    await _relay(h, placed(True), idle_s=60)  # no lease backend: no header
    assert seen == ["42", None]


async def test_a_chat_chunk_of_token_ids_alone_reaches_only_a_client_that_asked_for_them() -> None:
    # vLLM sends a chunk with an empty delta for a token its reasoning or tool parser held back only
    # when the client asked for token IDs (vLLM 0.32 chat_completion/serving.py: "continue" unless
    # return_token_ids); the router always asks, so a client that did not got chunks vLLM would
    # never have sent it. Its token still counts.
    held = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": [7]}]}
    stream = sse(ROLE, tok("a", [1]), held, tok("b", [2], "stop"))
    for asked in (False, True):
        msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(stream)),
                            placed(True, {"return_token_ids": True} if asked else None))
        data = b"".join(m.data for m in msgs)
        assert (b'"delta": {}' in data or b'"delta":{}' in data) == asked, data
        assert msgs[-1].final and msgs[-1].stats is not None and msgs[-1].stats.output_tokens == 3


async def test_a_chat_hiding_its_reasoning_is_counted_without_token_ids() -> None:
    # With include_reasoning: false and a reasoning or tool parser, vLLM 0.32 leaves the token IDs
    # out of every chunk (chat_completion/serving.py hide_stream_metadata): the token check failed
    # each answer as the engine's fault (a 502, its breaker charged). Such a chat is relayed as an
    # engine's without IDs: its output counted from the engine's usage, which the router asks for.
    sent: list[dict[str, Any]] = []
    usage = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    stream = sse(ROLE, tok("a", None), tok("b", None, "stop"), usage)

    def engine(r: httpx.Request) -> httpx.Response:
        sent.append(json.loads(r.content))
        return httpx.Response(200, stream=httpx.ByteStream(stream))

    for streamed in (True, False):
        sent.clear()
        msgs, _ = await run(engine, placed(streamed, {"include_reasoning": False}))
        final = msgs[-1]
        assert final.final and final.error is None, final.error
        assert final.stats is not None and final.stats.output_tokens == 5
        assert sent[0]["include_reasoning"] is False and sent[0]["stream_options"]["include_usage"] is True
