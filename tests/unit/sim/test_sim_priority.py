"""The simulator's priority scheduling (vLLM's priority policy): waiting requests are admitted by
priority then arrival; an engine without it refuses a non-zero priority, as vLLM does."""

from __future__ import annotations

import asyncio

import httpx

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.engine import Scheduler
from narwhal_serve.sim.server import start_server
from tests.support.net import free_port


async def test_waiters_are_admitted_by_priority_then_arrival() -> None:
    s = Scheduler(lambda: 1)
    await s.acquire()
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await s.acquire(priority)
        order.append(name)

    tasks = [asyncio.create_task(wait(n, p)) for n, p in (("late-batch", 2), ("first-std", 1), ("inter", 0), ("second-std", 1))]
    await asyncio.sleep(0)
    for _ in tasks:
        s.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["inter", "first-std", "second-std", "late-batch"]


async def test_an_engine_without_priority_scheduling_refuses_a_priority() -> None:
    body = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for enabled in (False, True):
        port = free_port()
        srv = await start_server(SimEngineConfig(name="s", priority_scheduling=enabled), "127.0.0.1", port)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
                r = await c.post("/v1/chat/completions", json={**body, "priority": 1})
                zero = await c.post("/v1/chat/completions", json={**body, "priority": 0})
        finally:
            await srv.stop()
        assert zero.status_code == 200
        if enabled:
            assert r.status_code == 200
        else:
            assert r.status_code == 400 and "Priority scheduling is not enabled" in r.text
