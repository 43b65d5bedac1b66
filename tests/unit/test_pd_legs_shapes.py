"""Differential review of Narwhal's P/D legs against the real engines and their own reference routers
(vLLM's toy_proxy_server / NixlConnector; SGLang's mini_lb.py, sgl-model-gateway pd_router.rs and its
disaggregation decode/conn code).  Each test names the real source it was checked against, and says
what broke against a real engine before it was handled (2026-12-06).

The vLLM two-step legs were checked too and match vLLM's own proxy (no test here): prefill body
``kv_transfer_params {do_remote_decode: true, do_remote_prefill: false, remote_*: None}``,
``stream: false``, ``max_tokens: 1``, ``stream_options`` / ``min_tokens`` dropped (``max_completion_tokens``
dropped where the proxy sets it to 1: the same limit), the prefill answer's ``kv_transfer_params``
(NixlConnector's ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``tp_size``) passed to the decode leg verbatim, one ``X-Request-Id`` on both legs.
SGLang's ``bootstrap_room`` (63 random bits) and the decode answer as the client's also match."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from typing import Any

import httpx
import pytest

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.engines.legs import _until_prefill_fails, open_route
from narwhal_serve.engines.sglang import SGLANG
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.pipeline import Relay
from tests.support.relay import faults_of


DECODE_GIVES_UP_S = 3.0  # (a stand-in for SGLANG_DISAGGREGATION_WAITING_TIMEOUT: 300 s by default)


class Stalled(httpx.AsyncByteStream):
    """A 200 streaming answer that sends nothing for ``hold`` seconds: an SGLang decode engine whose
    request sits in ``KVPoll.WaitingForInput``, waiting for KV that its prefill leg will never send."""

    def __init__(self, hold: float) -> None:
        self.hold = hold

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.hold)
        yield b"data: [DONE]\n\n"


def chat(stream: bool = True) -> Any:
    raw = json.dumps({"model": "m", "stream": stream, "max_tokens": 8,
                      "messages": [{"role": "user", "content": "q"}]})
    return parse_request("chat", raw.encode(), model="m")


async def test_sglang_pd_prefill_leg_failure_ends_the_attempt_without_waiting_for_the_decode_leg() -> None:
    """sgl-project/sglang PR #29017 (merged, sgl-model-gateway pd_router.rs
    ``execute_dual_dispatch_internal``: ``tokio::join!`` → ``tokio::select!``): "the decode worker cannot
    produce a single token without the KV cache transferred from prefill. So when the prefill request
    fails — a transport error, a 4xx, or a 5xx — the paired decode request ... blocks in
    ``KVPoll.WaitingForInput`` until ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (default 300s)"; the
    router now drops the decode leg the moment prefill fails (also PR #24159, issue #9726).

    Narwhal's ``_sglang_pd`` (engines/legs.py) starts the prefill leg as a task, then reads the decode
    stream to its end and only then awaits the prefill task: a prefill leg that failed at once
    (here a 500) is not seen until the decode engine gives up, minutes later.  Before headers, the
    attempt instead ends by the first-token limit (or the engine idle timeout, 60 s) and is charged to
    the decode engine as a ``timeout`` — not to the prefill engine that failed, as docs/contract.md
    ("Engine failures") says — and its decode slot stays held meanwhile.  vLLM's two-step fails the
    same fault at once, its decode leg never started (tests/fault/test_pd_faults.py)."""
    prefill = EngineConfig(name="p1", url="http://p1", role="prefill", dialect="sglang")
    decode = EngineConfig(name="d1", url="http://d1", role="decode", dialect="sglang")
    route = RouteChoice(kind="pd", decode=decode, prefill=prefill)

    def handler(r: httpx.Request) -> httpx.Response:
        if r.url.host == "p1":
            return httpx.Response(500, json={"object": "error", "message": "prefill scheduler crashed",
                                             "type": "InternalServerError", "param": None, "code": 500})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Stalled(DECODE_GIVES_UP_S))

    async def drive() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            async with aclosing(open_route(client, route, chat(), {"X-Request-Id": "rid-1"})) as legs:
                async for _ in legs:
                    pass

    started = time.monotonic()
    with pytest.raises(EngineFailure) as failed:
        await drive()
    took = time.monotonic() - started
    assert failed.value.engine == "p1", failed.value  # the failure is the prefill engine's
    assert took < 1.0, (f"the prefill leg failed with a 500 at once, but the attempt waited {took:.1f} s, until "
                        f"the decode engine gave up (real SGLang: SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s)")


def test_sglang_bootstrap_host_of_an_ipv6_prefill_engine_is_bracketed() -> None:
    """sgl-project/sglang python/sglang/srt/disaggregation/mini_lb.py (SGLang's own P/D balancer):
    ``hostname = maybe_wrap_ipv6_address(parsed_url.hostname)`` — an IPv6 prefill engine's
    ``bootstrap_host`` goes as ``[fd00::1]``.  The decode engine joins it with the port:
    ``bootstrap_addr=f"{req.bootstrap_host}:{req.bootstrap_port}"`` (disaggregation/decode.py, SGLang
    releases before ``NetworkAddress``) and asks ``http://{bootstrap_addr}/route?...``
    (common/conn.py).  Current SGLang's ``NetworkAddress`` strips brackets and adds them back, so the
    bracketed form works with every release.

    Narwhal's ``SGLangDialect.bootstrap_fields`` sends ``urlsplit(url).hostname``: ``fd00::1`` bare, so
    those releases' decode engine asks ``http://fd00::1:8998/route`` — not a URL — and aborts every
    P/D request whose prefill engine has an IPv6 address."""
    prefill = EngineConfig(name="p1", url="http://[fd00::1]:30000", role="prefill", dialect="sglang",
                           bootstrap_port=8998)
    boot = SGLANG.bootstrap_fields(prefill)
    addr = f"{boot['bootstrap_host']}:{boot['bootstrap_port']}"  # as SGLang's decode engine joins them
    try:
        url = httpx.URL(f"http://{addr}/route")
    except httpx.InvalidURL as exc:
        pytest.fail(f"bootstrap_host {boot['bootstrap_host']!r}: the decode engine's bootstrap address "
                    f"{addr!r} is not a host:port ({exc})")
    assert (url.host, url.port) == ("fd00::1", 8998), url
    assert boot["bootstrap_host"] == "[fd00::1]", boot


async def test_sglang_pd_prefill_leg_failure_is_charged_to_the_prefill_engine() -> None:
    """The same root cause as above, as the relay reports it (docs/contract.md, "Engine failures": a
    failed attempt is reported "with the engine it failed on (the prefill engine when a P/D prefill leg
    failed or went silent)").  With a first-token limit and another route, the attempt whose SGLang
    prefill leg answered 500 at once waits out the whole limit and is charged to its decode engine as a
    ``timeout``; the prefill engine's failure reaches no breaker (the task's exception is never
    retrieved)."""
    class Ok(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[no-untyped-def]
            head = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
            yield (b"data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                   "content": "hi"}, "finish_reason": "stop", "matched_stop": None}]}).encode() + b"\n\n"
                   b"data: " + json.dumps({**head, "choices": [], "usage": {"prompt_tokens": 1,
                   "completion_tokens": 1, "total_tokens": 2}}).encode() + b"\n\ndata: [DONE]\n\n")

    def handler(r: httpx.Request) -> httpx.Response:
        if r.url.host == "p1":
            return httpx.Response(500, json={"object": "error", "message": "prefill scheduler crashed"})
        if r.url.host == "d1":
            return httpx.Response(200, stream=Stalled(DECODE_GIVES_UP_S))
        if r.url.host == "p2":
            return httpx.Response(200, json={"id": "p", "object": "chat.completion", "choices": []})
        return httpx.Response(200, stream=Ok())

    def eng(name: str, role: str) -> EngineConfig:
        return EngineConfig(name=name, url=f"http://{name}", role=role, dialect="sglang")  # type: ignore[arg-type]

    routes = (RouteChoice(kind="pd", decode=eng("d1", "decode"), prefill=eng("p1", "prefill")),
              RouteChoice(kind="pd", decode=eng("d2", "decode"), prefill=eng("p2", "prefill")))
    placed = PlacedRequest("rid-1", "m", chat(), routes, time.time() + 30, first_token_s=1.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        msgs = [m async for m in Relay(client).run(placed)]
    assert msgs[-1].error is None, msgs[-1].error  # (the second route serves it)
    charged = [(f.engine, f.kind) for m in msgs for f in faults_of(m)]
    assert charged == [("p1", "error")], charged


async def _next_read(gen: Any, release_decode: asyncio.Event) -> str:
    """What ``gen``'s next read does within 0.5 s (then the decode stream is let go and ``gen`` closed)."""
    try:
        await asyncio.wait_for(gen.__anext__(), 0.5)
    except EngineFailure:
        return "raised at once"
    except TimeoutError:
        return "still waiting on the decode stream"
    finally:
        release_decode.set()
        await gen.aclose()
    return "other"


def test_a_prefill_failure_while_a_decode_batch_is_out_is_raised_at_the_next_read() -> None:
    """The prefill leg fails while the consumer holds a decode batch: the next read raises it (it
    waited on the decode stream, the failure surfacing only when that ended: SGLang, up to 300 s).
    From a review of this stop's diff."""

    async def main() -> str:
        release_decode = asyncio.Event()

        async def decode():
            yield [{"first": 1}]
            await release_decode.wait()  # decode engine waits for KV that never comes
            yield [{"second": 2}]

        fail_prefill = asyncio.Event()

        async def prefill() -> dict[str, Any]:
            await fail_prefill.wait()
            raise EngineFailure("p1", "HTTP 500")

        pre_task = asyncio.ensure_future(prefill())
        gen = _until_prefill_fails(decode(), pre_task)
        first = await gen.__anext__()
        assert first == [{"first": 1}]
        # consumer busy writing the first batch; meanwhile the prefill leg fails
        fail_prefill.set()
        await asyncio.sleep(0.01)
        assert pre_task.done() and pre_task.exception() is not None
        return await _next_read(gen, release_decode)

    assert asyncio.run(main()) == "raised at once"


def test_a_prefill_failure_in_the_same_wakeup_as_a_decode_batch_is_raised_at_the_next_read() -> None:
    """Both complete before the wait returns: the batch is yielded, and the failure raised at the
    next read (it was never acted on)."""

    async def main() -> str:
        release_decode = asyncio.Event()
        go = asyncio.Event()

        async def decode():
            await go.wait()
            yield [{"first": 1}]
            await release_decode.wait()
            yield [{"second": 2}]

        async def prefill() -> dict[str, Any]:
            await go.wait()
            raise EngineFailure("p1", "HTTP 500")

        pre_task = asyncio.ensure_future(prefill())
        gen = _until_prefill_fails(decode(), pre_task)
        asyncio.get_running_loop().call_later(0.01, go.set)
        first = await gen.__anext__()
        assert first == [{"first": 1}]
        return await _next_read(gen, release_decode)

    assert asyncio.run(main()) == "raised at once"


class _Ok(httpx.AsyncByteStream):
    async def __aiter__(self):  # type: ignore[no-untyped-def]
        head = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        yield (b"data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
               "content": "hi"}, "finish_reason": "stop"}]}).encode() + b"\n\n"
               b"data: " + json.dumps({**head, "choices": [], "usage": {"prompt_tokens": 1,
               "completion_tokens": 1, "total_tokens": 2}}).encode() + b"\n\ndata: [DONE]\n\n")


class _Stalled(httpx.AsyncByteStream):
    async def __aiter__(self):  # type: ignore[no-untyped-def]
        await asyncio.sleep(3)
        yield b"data: [DONE]\n\n"


def test_a_failed_sglang_prefill_engine_is_the_one_left_out_of_the_next_routes() -> None:
    """The relay leaves the engine its cursor names out of the next routes: the prefill engine while
    its leg is out (it named the decode engine: the failed p1 was tried again and the healthy d0
    left out, so the route (p2, d0) that serves was skipped), as vLLM's two-step does."""
    def eng(name: str, role: str) -> EngineConfig:
        return EngineConfig(name=name, url=f"http://{name}", role=role, dialect="sglang")  # type: ignore[arg-type]

    def chat() -> Any:
        raw = json.dumps({"model": "m", "stream": True, "max_tokens": 8,
                          "messages": [{"role": "user", "content": "q"}]})
        return parse_request("chat", raw.encode(), model="m")

    routes = (RouteChoice(kind="pd", decode=eng("d0", "decode"), prefill=eng("p1", "prefill")),
              RouteChoice(kind="pd", decode=eng("d2", "decode"), prefill=eng("p1", "prefill")),
              RouteChoice(kind="pd", decode=eng("d0", "decode"), prefill=eng("p2", "prefill")))

    def handler2(r: httpx.Request) -> httpx.Response:
        if r.url.host == "p1":
            return httpx.Response(500, json={"object": "error", "message": "prefill crashed"})
        if r.url.host == "p2":
            return httpx.Response(200, json={"id": "p", "object": "chat.completion", "choices": []})
        if r.url.host == "d0":
            body = json.loads(r.content)
            # the decode engine d0 is healthy: it serves once its paired prefill is p2
            return httpx.Response(200, stream=_Ok() if body.get("bootstrap_host") == "p2" else _Stalled())
        return httpx.Response(200, stream=_Stalled())

    async def main() -> Any:
        placed = PlacedRequest("rid-1", "m", chat(), routes, time.time() + 30, first_token_s=5.0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler2)) as client:
            return [m async for m in Relay(client).run(placed)]

    msgs = asyncio.run(main())
    assert msgs[-1].error is None, msgs[-1].error
