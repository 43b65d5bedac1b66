"""The hot path through the Ray graph: admissions under a held lease make no scheduler call, and a
client that leaves a stalled stream is released within two keep-alive intervals."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.integration.conftest import KEEPALIVE_S, Graph
from tests.integration.helpers import AUTH, Held, balanced, chat_body, status, wait_engine_idle, wait_status


async def test_admissions_under_a_held_lease_make_no_scheduler_call(graph: Graph) -> None:
    g = graph.tight_url
    async with httpx.AsyncClient(timeout=30) as c:
        warm = await c.post(g + "/v1/chat/completions", json=chat_body(), headers=AUTH)
        assert warm.status_code == 200
        before = (await status(g))["scheduler_calls"]
        for i in range(10):
            r = await c.post(g + "/v1/chat/completions", json=chat_body(f"n{i}"), headers=AUTH)
            assert r.status_code == 200, r.text
        after = (await status(g))["scheduler_calls"]
    assert after["admit"] == before["admit"], (before, after)
    assert after["report"] > before["report"]  # outcomes and releases still flow, batched
    assert after["watch"] >= 1  # the replica's placement-news call is parked at the scheduler, through Ray
    snap = await wait_status(g, balanced, "counters balance and permits are back")
    assert snap["admission_leases"] and all(x["in_use"]["retention"] == 0 for x in snap["admission_leases"])


async def test_a_client_leaving_a_stalled_stream_is_released_within_two_keepalives(graph: Graph) -> None:
    g = graph.tight_url
    url = g + "/v1/chat/completions"
    # the role chunk and the first token, then the engine goes silent
    held = Held(url, chat_body(stream=True, sim={"fault": "hang_mid_stream", "fault_after": 2}), AUTH)
    await asyncio.wait_for(held.first_chunk.wait(), 30)
    await wait_status(g, lambda s: s["gauges"]["decode_inflight"] == 1, "the stream decoding")
    await asyncio.sleep(2 * KEEPALIVE_S)  # keep-alives are flowing to a client still there
    assert held.failed() is None
    t0 = time.monotonic()
    await held.cancel()
    await wait_status(g, lambda s: s["gauges"]["retained"] == 0, "the stream released", timeout=10)
    took = time.monotonic() - t0
    assert took <= 2 * KEEPALIVE_S + 0.5, f"released after {took:.2f} s"  # 0.5 s: /status polling
    await wait_status(g, balanced, "counters balance and permits are back")
    await wait_engine_idle(graph.tight_sim_url)  # the engine request was aborted too


async def test_keepalives_reach_a_client_of_a_silent_stream(graph: Graph) -> None:
    g = graph.tight_url
    body = chat_body(stream=True, sim={"fault": "hang_mid_stream", "fault_after": 2})
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", g + "/v1/chat/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            seen = b""
            async with asyncio.timeout(10 * KEEPALIVE_S + 5):
                async for part in r.aiter_raw():
                    seen += part
                    # after the last event, each keep-alive is one more empty line
                    if len(seen) - len(seen.rstrip(b"\n")) - 2 >= 2:
                        break
    assert seen.startswith(b"data: ")
    await wait_status(g, balanced, "counters balance and permits are back")
