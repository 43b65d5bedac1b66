"""The seed's unsized_offered: a body that ends before sizing counts as offered and unsized_offered,
and ends as cancelled.  In direct-ingress mode (the run mode) it reaches the ingress every time;
behind Serve's proxy actor (the other mode) a body that never completes never reaches it."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.integration.conftest import Graph
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
