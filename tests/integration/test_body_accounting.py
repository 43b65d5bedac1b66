"""The contract's unsized_offered: a body that ends before sizing counts as offered and unsized_offered,
and ends as cancelled.  In direct-ingress mode (the run mode) it reaches the ingress every time;
behind Serve's proxy actor (the other mode) a body that never completes never reaches it."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.integration.conftest import BODY_TIMEOUT_S, Graph
from tests.integration.helpers import AUTH, balanced, status, wait_status

DIRECT_INGRESS = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"


async def _short_body(host: str, port: int, path: str) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: {AUTH['Authorization']}\r\nContent-Length: 400\r\n\r\n")
    writer.write(head.encode() + b'{"model": "narwhal-sim", "messages": [')
    await writer.drain()
    await asyncio.sleep(0.3)  # the ingress is reading the body
    writer.close()
    await writer.wait_closed()


@pytest.mark.skipif(not DIRECT_INGRESS, reason="the proxy actor never forwards an incomplete body")
async def test_a_body_that_ends_early_counts_unsized_offered_every_time(graph: Graph) -> None:
    g = graph.tight_url
    host, port = g.split("//")[1].split("/")[0].split(":")
    before = (await status(g))["counters"]
    for _ in range(5):
        await _short_body(host, int(port), "/tight/v1/chat/completions")
    snap = await wait_status(
        g, lambda s: s["counters"]["unsized_offered"] >= before["unsized_offered"] + 5 and balanced(s),
        "five unsized offered requests, counters balanced")
    c = snap["counters"]
    assert c["offered"] - before["offered"] == 5
    assert c["unsized_offered"] - before["unsized_offered"] == 5
    assert c["cancelled"] - before["cancelled"] == 5


@pytest.mark.skipif(not DIRECT_INGRESS, reason="the proxy actor never forwards an incomplete body")
async def test_a_body_trickled_past_the_body_timeout_gets_a_408_in_the_envelope(graph: Graph) -> None:
    g = graph.tight_url
    host, port = g.split("//")[1].split("/")[0].split(":")
    before = (await status(g))["counters"]
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (f"POST /tight/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: {AUTH['Authorization']}\r\nContent-Length: 400\r\n\r\n")
    writer.write(head.encode() + b'{"model": "narwhal-sim", ')
    await writer.drain()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S + 10):  # the client keeps the connection, sends no more
            head_bytes = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":", 1)[1]) for line in head_bytes.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            payload = await reader.readexactly(length)
    finally:
        writer.close()
    assert b" 408 " in head_bytes.split(b"\r\n", 1)[0], head_bytes[:200]
    body = json.loads(payload)
    assert body["error"]["code"] == "request_timeout" and body["error"]["type"] == "invalid_request_error"
    snap = await wait_status(g, balanced, "counters balanced")
    c = snap["counters"]
    assert (c["offered"] - before["offered"], c["unsized_offered"] - before["unsized_offered"]) == (1, 1)
    assert c["invalid_requests"] - before["invalid_requests"] == 1
