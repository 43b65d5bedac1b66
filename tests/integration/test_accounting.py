"""Global accounting: a burst of mixed outcomes after which every permit and queue slot is back and
offered equals the sum of the terminal classes.

(unsized_offered is tested in-process in tests/unit/gateway: Ray Serve's proxy holds a request until
its body is complete, so a body that ends early never reaches the ingress under Ray.)"""

from __future__ import annotations

import asyncio

import httpx

from tests.integration.conftest import Graph
from tests.integration.helpers import AUTH, balanced, chat_body, wait_status


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

    codes = await asyncio.gather(*(one(i) for i in range(40)))
    assert set(codes) <= {-1, 200, 400, 429, 504}, codes
    assert codes.count(400) == 8
    snap = await wait_status(g, balanced, "every permit and queue slot back, counters balanced", timeout=30)
    assert snap["counters"]["cancelled"] >= 1 and snap["counters"]["rejected"] >= 1
