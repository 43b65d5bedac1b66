"""Timing model (pure), prefix cache, and real-server timing/concurrency behaviour."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from sim_testutil import CHAT, COMPLETIONS, sim_client

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.server import SimServer, start_server
from narwhal_serve.sim.timing import (
    PrefixCache,
    block_hashes,
    next_token_deadline,
    prefill_deadline,
    prefill_seconds,
    token_interval,
)


def test_pure_timing_functions() -> None:
    cfg = SimEngineConfig(prefill_overhead_s=0.01, prefill_per_token_s=0.001, tpot_base_s=0.02,
                          tpot_per_running_s=0.005)
    assert prefill_seconds(cfg, 100) == pytest.approx(0.11)
    assert prefill_deadline(cfg, 5.0, 0) == pytest.approx(5.01)
    assert token_interval(cfg, 4) == pytest.approx(0.04)
    assert next_token_deadline(cfg, 1.0, 1.005, 0) == pytest.approx(1.02)  # anchored on the last deadline
    assert next_token_deadline(cfg, 1.0, 3.0, 0) == 3.0  # never in the past


def test_block_hashes_and_prefix_cache() -> None:
    a, b = list(range(40)), list(range(32)) + [99] * 8
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 2 and ha == hb  # only full blocks, chained
    assert block_hashes([7] + a[1:], 16)[1] != ha[1]
    cache = PrefixCache(capacity=3)
    assert cache.cached_tokens(ha, 16) == 0
    ids = cache.insert(ha)
    assert cache.cached_tokens(ha, 16) == 32 and cache.insert(ha) == ids
    cache.insert(block_hashes(list(range(100, 148)), 16))  # 3 more blocks evict the LRU ones
    assert len(cache) == 3 and cache.cached_tokens(ha, 16) == 0


async def test_prefix_cache_and_decode_leg_skip_prefill() -> None:
    prompt = " ".join(f"w{i}" for i in range(300))
    async with sim_client(prefill_overhead_s=0.0, prefill_per_token_s=0.0005, tpot_base_s=0.0) as c:
        t0 = time.perf_counter()
        await c.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        await c.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
        warm = time.perf_counter() - t0
        hits = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", (await c.get("/metrics")).text, re.M)
    assert cold >= 0.15 and warm < cold / 2
    assert hits is not None and float(hits.group(1)) > 0
    async with sim_client(prefill_overhead_s=0.2, tpot_base_s=0.0, role="decode") as c:
        t0 = time.perf_counter()
        body = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}}
        assert (await c.post(COMPLETIONS, json=body)).status_code == 200
        assert time.perf_counter() - t0 < 0.15


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    srv = await start_server(SimEngineConfig(max_num_seqs=1, tpot_base_s=0.02, tpot_per_running_s=0.0,
                                             eos_prob=0.0), "127.0.0.1", 0)
    try:
        yield srv
    finally:
        await srv.stop()


async def test_tokens_stream_as_produced_and_control_changes_timing(server: SimServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as c:
        arrivals: list[float] = []
        async with c.stream("POST", CHAT, json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())
        # role chunk, 5 token chunks (one per 0.02 s decode step, sent as produced), [DONE].  Client
        # and server share this event loop: a stall of it delays one arrival and shortens the gap
        # after it (the next deadline is anchored on the last one), so at most one gap is short.
        assert len(arrivals) == 7
        gaps = sorted(b - a for a, b in zip(arrivals[1:5], arrivals[2:6], strict=True))
        assert gaps[1] >= 0.02 * 0.5 and arrivals[5] - arrivals[1] >= 2 * 0.02, gaps
        r = await c.post("/sim/control", json={"tpot_base_s": 0.0})
        assert r.json()["tpot_base_s"] == 0.0
        t0 = time.perf_counter()
        await c.post(CHAT, json={**body, "stream": False, "max_tokens": 40})
        assert time.perf_counter() - t0 < 0.4  # would take >= 0.78 s at 0.02 s/token


async def _metric(c: httpx.AsyncClient, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", (await c.get("/metrics")).text, re.M)
    assert m is not None
    return float(m.group(1))


async def test_max_num_seqs_queueing_shows_in_metrics(server: SimServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as c:
        async with c.stream("POST", CHAT, json=body) as first:
            lines = first.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # the first request holds the only slot
            second = asyncio.create_task(c.post(CHAT, json={**body, "stream": False, "max_tokens": 2}))
            for _ in range(200):  # the second request reaches the engine's queue over HTTP
                if await _metric(c, "vllm:num_requests_waiting") == 1.0:
                    break
                await asyncio.sleep(0.005)
            assert await _metric(c, "vllm:num_requests_waiting") == 1.0
            assert await _metric(c, "vllm:num_requests_running") == 1.0
            assert not second.done()
            await c.post("/sim/control", json={"tpot_base_s": 0.0})
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert (await second).status_code == 200
        assert await _metric(c, "vllm:num_requests_waiting") == 0.0
        assert await _metric(c, "vllm:num_requests_running") == 0.0


async def test_stats_tell_how_late_the_host_let_prefills_wake() -> None:
    """``/sim/stats`` → ``timer``: each prefill's modelled time and its wake-up after its deadline
    (what a check against a replay reads to know whether the host kept the engine's timing)."""
    async with sim_client(prefill_overhead_s=0.05, prefill_per_token_s=0.0, tpot_base_s=0.001) as c:
        body = {"prompt": "hi", "max_tokens": 1}
        assert (await c.post(COMPLETIONS, json=body)).status_code == 200
        alone = (await c.get("/sim/stats")).json()["timer"]
        task = asyncio.create_task(c.post(COMPLETIONS, json=body))
        while (await c.get("/sim/stats")).json()["running"] == 0:  # its prefill has started
            await asyncio.sleep(0)
        time.sleep(0.2)  # the host busy elsewhere: the event loop runs nothing meanwhile
        assert (await task).status_code == 200
        held = (await c.get("/sim/stats")).json()["timer"]
    assert alone["prefills"] == 1 and alone["prefill_s"] == pytest.approx(0.05)
    assert alone["prefill_late_s"] < 0.05
    assert held["prefills"] == 2 and held["prefill_s"] == pytest.approx(0.1)
    assert held["prefill_late_s"] - alone["prefill_late_s"] >= 0.14
