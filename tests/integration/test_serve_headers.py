"""Ray Serve reads two request headers as client controls — its own per-request timeout and a
switch that stops it cancelling requests whose client left. Narwhal's HAProxy wrapper drops both
(direct-ingress mode): only Narwhal's documented deadline headers apply, and disconnects are seen.
It also stamps each request with its receipt, from which its TTFT is counted."""

from __future__ import annotations

import asyncio
import json
import os
import time

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


async def _expect_with_late_body(url: str, body: bytes, headers: dict[str, str], late_s: float) -> tuple[int, bytes]:
    """A request with ``Expect: 100-continue`` whose body follows ``late_s`` after HAProxy's 100:
    HAProxy holds it until the body's first byte (runenv), so it reaches the replica that late."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n{head}\r\n").encode())
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        await asyncio.sleep(late_s)
        writer.write(body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(next(ln.split(b":", 1)[1] for ln in status_line.split(b"\r\n")
                          if ln.lower().startswith(b"content-length:")))
        return int(status_line.split(b" ")[1]), await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()


async def test_the_ttft_budget_counts_from_haproxys_receipt(graph: Graph) -> None:
    """HAProxy stamps each request when it reads its head (``x-narwhal-received-us``, set over a
    client's copy): a request held 1.5 s before it reaches the replica has waited that much of its
    1 s TTFT budget and is refused; a client's own stamp (30 s old) is replaced, not believed."""
    body = json.dumps(chat_body()).encode()
    code, answer = await _expect_with_late_body(graph.url, body, {"X-TTFT-Target": "1"}, 1.5)
    assert code == 429, answer
    err = json.loads(answer)["error"]
    assert err["code"] == "ttft_budget_exceeded" and "it has waited since it reached the router" in err["message"]
    code, answer = await _expect_with_late_body(graph.url, body, {"X-TTFT-Target": "1"}, 0.0)
    assert code == 200, answer
    old = str(int((time.time() - 30) * 1e6))
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(graph.url + "/v1/chat/completions", json=chat_body(),
                         headers={"X-TTFT-Target": "1", "x-narwhal-received-us": old})
    assert r.status_code == 200, r.text
