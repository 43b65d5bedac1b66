"""Global accounting: a burst of mixed outcomes after which every permit and queue slot is back and
offered equals the sum of the terminal classes.

(unsized_offered is tested in-process in tests/unit/gateway: Ray Serve's proxy holds a request until
its body is complete, so a body that ends early never reaches the ingress under Ray.)"""

from __future__ import annotations

import asyncio

import httpx

from tests.integration.conftest import Graph
from tests.integration.helpers import AUTH, Held, balanced, chat_body, status, wait_status


async def test_burst_of_mixed_outcomes_balances(graph: Graph) -> None:
    g = graph.tight_url
    url = g + "/v1/chat/completions"

    async def one(i: int) -> int:
        kind = i % 5
        async with httpx.AsyncClient(timeout=30) as c:
            if kind == 0:  # a client that gives up while its request hangs at the engine or in the queue
                try:
                    r = await c.post(url, json=chat_body(sim={"fault": "hang"}), headers=AUTH, timeout=0.5)
                except httpx.TimeoutException:
                    return -1
                return r.status_code  # refused at once (queue or retention full)
            if kind == 1:
                return (await c.post(url, json={"model": "narwhal-sim"}, headers=AUTH)).status_code
            if kind == 2:
                return (await c.post(url, json=chat_body(stream=True), headers=AUTH)).status_code
            if kind == 3:
                return (await c.post(url, json=chat_body(), headers={**AUTH, "X-Request-Timeout": "2"})).status_code
            return (await c.post(url, json=chat_body(), headers=AUTH)).status_code

    before = (await status(g))["counters"]
    held = Held(url, chat_body(sim={"fault": "hang"}), AUTH)  # in flight while the burst arrives
    await wait_status(g, lambda s: s["gauges"]["prefill_inflight"] == 1, "the held request admitted")
    codes = await asyncio.gather(*(one(i) for i in range(40)))
    await held.cancel()  # its client disconnects
    assert set(codes) <= {-1, 200, 400, 429, 504}, codes
    assert codes.count(400) == 8
    snap = await wait_status(g, balanced, "every permit and queue slot back, counters balanced", timeout=30)
    c = snap["counters"]
    assert c["offered"] == before["offered"] + 41
    assert c["cancelled"] > before["cancelled"] and c["rejected"] > before["rejected"]
