"""Ray Serve reads two request headers as client controls — its own per-request timeout and a
switch that stops it cancelling requests whose client left. Narwhal's HAProxy wrapper drops both
(direct-ingress mode): only Narwhal's documented deadline headers apply, and disconnects are seen."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from tests.integration.conftest import Graph
from tests.integration.helpers import AUTH, Held, balanced, chat_body, counter, status, wait_status

pytestmark = pytest.mark.skipif(os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1",
                                reason="the headers are dropped by Narwhal's HAProxy wrapper (direct ingress)")


async def test_serve_request_timeout_header_is_not_a_client_control(graph: Graph) -> None:
    g = graph.tight_url
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(g + "/v1/chat/completions", json=chat_body(sim={"fault": "hang"}),
                         headers={**AUTH, "x-request-timeout-seconds": "0.3", "X-Request-Timeout": "1.5"})
    assert r.status_code == 504, r.text  # Narwhal's deadline, in the envelope — not Serve's 408 at 0.3 s
    assert r.json()["error"]["code"] == "deadline_expired"
    await wait_status(g, balanced, "counters balance and permits are back")


async def test_disconnect_disabled_header_does_not_keep_a_request_alive(graph: Graph) -> None:
    g = graph.tight_url
    before = counter(await status(g), "cancelled", "client_disconnected")
    held = Held(g + "/v1/chat/completions", chat_body(sim={"fault": "hang"}),
                {**AUTH, "x-request-disconnect-disabled": "?1"})
    await wait_status(g, lambda s: s["gauges"]["prefill_inflight"] == 1, "admitted")
    await asyncio.sleep(0.2)
    await held.cancel()
    snap = await wait_status(g, balanced, "released after the client left", timeout=10)
    assert counter(snap, "cancelled", "client_disconnected") == before + 1


async def test_headers_that_never_finish_get_a_408_and_a_closed_connection(graph: Graph) -> None:
    """Slowloris on headers: HAProxy's header timeout (NARWHAL_HTTP_HEADER_TIMEOUT_S, 2 s here).
    (The body is HAProxy's own page: 2.8 answers this one before errorfile/http-error apply.)"""
    host, port = graph.url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic")
    await writer.drain()
    t0 = asyncio.get_running_loop().time()
    try:
        async with asyncio.timeout(2 + 10):
            answer = await reader.read(-1)  # everything until HAProxy closes the connection
    finally:
        writer.close()
    took = asyncio.get_running_loop().time() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 1.5 <= took < 12, took
