"""Differential review of Narwhal's refusals, headers and SSE events against the clients that read
them: openai-python 3.57 (installed), openai-node (src/client.ts, src/core/streaming.ts), vLLM's
``vllm bench serve`` client (vllm/benchmarks/lib/endpoint_request_func.py) and docs/contract.md.

Each test failed, before its fix, because of the difference it names:

- a keep-alive SSE comment written alone (``: keep-alive``, after ``serving.stream_keepalive_s``
  of silence) poisons the buffer of vLLM's bench client, a client docs/performance.md calls
  supported: every event after it is lost;
- openai-node sends ``X-Stainless-Timeout: 0`` for any timeout under a second, which Narwhal
  refuses with a 400 on every request;
- answers to a budgeted tenant that fail after admission (or before it, on a malformed body) carry
  no ``x-ratelimit-*`` headers, though the contract says every answer does;
- an unexpected exception in a route outside the completion routes answers a plain-text 500, not
  the envelope the contract promises for every error.

The gateway runs in-process (no Ray): over a scripted backend called as an ASGI app, or as the
whole router over simulated engines (tests/support/local_router.py).
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.gateway.app import GatewayApp, build_api
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.sse import DONE_EVENT, sse_event
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult
from tests.support.local_router import LocalRouter, start_local_router
from tests.support.fleetless import NoFleet as _NoFleet

CHAT = "/v1/chat/completions"
MODEL = "narwhal-sim"


# ------------------------------------------------------------------------------ scripted backend

class _Scripted(_NoFleet):
    """A backend that admits everything onto one engine and relays what ``script`` yields."""

    def __init__(self, script: Any) -> None:
        self.script = script

    async def admit(self, req: AdmitRequest) -> AdmitResult:
        return AdmitResult(candidates=(RouteChoice("single", EngineConfig(name="u0", url="http://u0")),))

    async def cancel(self, ticket_id: str) -> None:
        return None

    async def admin(self, op: str, arg: Any) -> Any:
        return None

    def relay(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        return self.script(placed)  # type: ignore[no-any-return]


def _app(backend: Any, **cfg: Any) -> GatewayApp:
    conf = NarwhalConfig.model_validate({"admission": {"mode": "open", "ingress_leases": False},
                                         "sim": {"engines": [{"name": "u0"}]}, **cfg})
    return build_api(conf, backend)


def _chunk(text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def _answer() -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


async def _asgi_post(app: GatewayApp, path: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], list[bytes]]:
    """POST straight to the ASGI app: (status, headers, each body write as the app made it).  A
    write that follows a pause reaches a client as a network read of its own."""
    raw = json.dumps(body).encode()
    hdrs = [(b"host", b"t"), (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": hdrs, "client": ("127.0.0.1", 1), "server": ("t", 80)}
    done = asyncio.Event()
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    start: dict[str, Any] = {}
    writes: list[bytes] = []

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            start.update(msg)
        elif msg["type"] == "http.response.body":
            if msg.get("body"):
                writes.append(msg["body"])
            if not msg.get("more_body"):
                done.set()

    async with asyncio.timeout(20):
        await app(scope, receive, send)
    done.set()
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, writes


# ------------------------------------------------------------------ 1. keep-alive vs vllm bench

def _vllm_bench_read(reads: list[bytes]) -> tuple[list[str], bool]:
    """What ``vllm bench serve`` gets from these network reads (vllm/benchmarks/lib/
    endpoint_request_func.py, ``async_request_openai_chat_completions`` and its
    ``StreamedResponseHandler``), restated: each read is stripped of surrounding whitespace and
    added to a buffer; complete events are cut off at blank lines (one that starts with ``:`` is
    a comment, skipped); what is left is taken as an event only when it starts with ``data: ``
    and is ``[DONE]`` or whole JSON.  Returns the delta contents and whether [DONE] came."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffer = ""
    contents: list[str] = []
    done = False
    for read in reads:
        read = read.strip()
        if not read:
            continue
        buffer += decoder.decode(read)
        events: list[str] = []
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            if event.strip():
                events.append(event.strip())
        if buffer.startswith("data: "):
            rest = buffer[len("data: "):].strip()
            if rest == "[DONE]":
                events.append(buffer.strip())
                buffer = ""
            elif rest:
                try:
                    json.loads(rest)
                except json.JSONDecodeError:
                    pass
                else:
                    events.append(buffer.strip())
                    buffer = ""
        for event in events:
            if event.startswith(":"):
                continue
            payload = event.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                continue
            data = json.loads(payload)
            if choices := data.get("choices"):
                contents.append(choices[0]["delta"].get("content") or "")
    return contents, done


async def test_a_keepalive_during_a_stall_does_not_lose_the_rest_of_the_stream_for_vllm_bench() -> None:
    """An engine silent for longer than ``stream_keepalive_s`` mid-answer (a stall, a mid-stream
    resume's prefill: up to ``serving.resume_first_token_s``, 10 s, against a 5 s keep-alive) makes
    Narwhal write ``: keep-alive`` on its own.  vLLM's bench client strips each read and keeps a
    lone comment in its buffer; every later event is glued behind it and never parsed: the rest
    of the answer, its usage and [DONE] are lost while the request still counts as a success
    (vLLM's own server sends no comments, so this is Narwhal's difference)."""

    async def stalls(placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        yield RelayMessage(data=sse_event(_chunk("a")), first_token=True, engines=("u0",))
        await asyncio.sleep(0.3)  # the engine is silent: keep-alives go out
        yield RelayMessage(data=sse_event(_chunk("b")), tokens=2)
        yield RelayMessage(data=sse_event(_chunk("c")), tokens=3)
        yield RelayMessage(data=DONE_EVENT, final=True)

    app = _app(_Scripted(stalls), serving={"stream_keepalive_s": 0.05})
    status, _, writes = await _asgi_post(app, CHAT, {"model": MODEL, "stream": True,
                                                     "messages": [{"role": "user", "content": "x"}]})
    assert status == 200
    assert any(w.startswith(b"data: ") and b'"b"' in w for w in writes)  # (the router did send it all)
    contents, done = _vllm_bench_read(writes)
    assert contents == ["a", "b", "c"] and done, f"vllm bench got {contents}, [DONE]: {done}; reads: {writes}"
    await app.state.reporter.stop()  # (no lifespan runs here)


# ------------------------------------------------------------ 2. openai-node's X-Stainless-Timeout

async def test_openai_node_sub_second_timeout_header_is_not_refused() -> None:
    """openai-node sends ``'X-Stainless-Timeout': String(Math.trunc(options.timeout / 1000))``
    (src/client.ts, buildHeaders), the timeout being milliseconds: a client with ``timeout: 500``
    sends ``0`` on every request.  Narwhal reads the header as a deadline and refuses a
    non-positive one with a 400, so such a client can make no request at all."""

    async def answers(placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        yield RelayMessage(first_token=True, engines=("u0",))
        yield RelayMessage(data=json.dumps(_answer()).encode(), final=True)

    app = _app(_Scripted(answers))
    status, _, writes = await _asgi_post(app, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                                         {"X-Stainless-Timeout": "0", "X-Stainless-Retry-Count": "0"})
    assert status == 200, b"".join(writes).decode()
    await app.state.reporter.stop()


# ------------------------------------------------- 3. x-ratelimit-* on every answer to a tenant

KEY = "sk-review-acme-1"


@pytest.fixture
async def budgeted() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({
        "admission": {"mode": "open"},
        "sim": {"engines": [{"name": "u", "role": "unified"}], "kv_events": False},
        "tenants": {"list": [{"name": "acme", "key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                              "requests_per_minute": 600}]},
    })
    yield r
    await r.stop()


@pytest.mark.parametrize("extra,status,code", [
    ({"sim": {"fault": "unsupported_field"}}, 502, "bad_engine_response"),  # admitted; the engine's answer refused
    ({"sim": {"fault": "error_500"}}, 502, "bad_engine_response"),  # admitted; the engine failed
    ({"sim": {"fault": "error_429"}}, 503, "backend_unavailable"),  # admitted; the engine pushed back
    ({"messages": "not a list"}, 400, "invalid_request"),  # the tenant identified, its body malformed
], ids=["assembler-502", "engine-500", "engine-backpressure-503", "malformed-400"])
async def test_every_answer_to_a_budgeted_tenant_carries_the_rate_limit_headers(
        budgeted: LocalRouter, extra: dict[str, Any], status: int, code: str) -> None:
    """docs/contract.md, "Tenants": "Every answer to a budgeted tenant carries OpenAI's
    x-ratelimit-limit-requests, x-ratelimit-remaining-requests, x-ratelimit-reset-requests ...".
    The gateway adds them to a 200 and to an admission refusal (``_with_limits``), but not to an
    error after admission (``_respond`` answers ``error_response(first.error, rid)``: the admitted
    request was charged to the budget) nor to a refusal of a malformed body (``handle``'s
    ``_refused``).  A client that paces itself on them (the admitted request's charge included)
    reads nothing there."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with httpx.AsyncClient(base_url=budgeted.url, timeout=30,
                                 headers={"Authorization": f"Bearer {KEY}"}) as c:
        ok = await c.post(CHAT, json=body)  # the lease hears of the tenant (its share), as any client's first
        assert ok.status_code == 200 and ok.headers["x-ratelimit-limit-requests"] == "600", ok.text
        r = await c.post(CHAT, json={**body, **extra})
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert r.headers.get("x-ratelimit-limit-requests") == "600", dict(r.headers)
    assert "x-ratelimit-remaining-requests" in r.headers and "x-ratelimit-reset-requests" in r.headers


# ------------------------------------------------------------- 4. the envelope on every route

async def test_an_unexpected_failure_in_a_plain_route_answers_in_the_envelope() -> None:
    """docs/contract.md, "Errors": "Always {"error": {"message", "type", "param", "code"}}", and
    the row "a fault of the router itself before response headers (an unexpected exception in a
    route ...) → 500 internal_error".  The completion routes keep it (``_call_fast``); the
    FastAPI routes do not: a backend call that fails (the scheduler's handle, in the Ray graph)
    is answered by Starlette's ``text/plain`` "Internal Server Error", which an OpenAI client
    reads as an error with no type or code."""

    class Failing(_Scripted):
        async def snapshot(self) -> dict[str, Any]:
            raise RuntimeError("the scheduler could not be reached")

    app = _app(Failing(None))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.get("/ready")
    assert r.status_code == 500
    assert r.headers["content-type"].startswith("application/json"), (r.headers["content-type"], r.text)
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("internal_error", "internal_error")
