"""Driving an in-process Ray Serve graph from tests: bounded /status polling, engine idleness,
held-open requests and run-time engine (de)registration. Shared by tests/integration and tests/fault."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx

from narwhal_serve.admission.counters import unbalanced
from tests.support.ray_env import ADMIN_TOKEN

MODEL = "narwhal-sim"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def status(base: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(base + "/status")
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out


async def wait_status(base: str, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 15.0) -> dict[str, Any]:
    """Poll /status until ``pred`` holds (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        snap = await status(base)
        if pred(snap):
            return snap
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}; last status: {snap['gauges']} {snap['counters']}")
        await asyncio.sleep(0.05)


async def wait_ready(base: str, want: int, timeout: float = 15.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    async with httpx.AsyncClient(timeout=10) as c:
        while True:
            r = await c.get(base + "/ready")
            if r.status_code == want:
                out: dict[str, Any] = r.json()
                return out
            if loop.time() > end:
                raise AssertionError(f"/ready stayed {r.status_code}: {r.text}")
            await asyncio.sleep(0.05)


async def wait_engine_idle(sim_url: str, timeout: float = 15.0) -> None:
    """Poll a simulated engine until it runs and queues nothing (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    async with httpx.AsyncClient(timeout=10) as c:
        while True:
            st = (await c.get(sim_url + "/sim/stats")).json()
            if st["running"] == 0 and st["waiting"] == 0:
                return
            if loop.time() > end:
                raise AssertionError(f"engine still busy: running={st['running']} waiting={st['waiting']}")
            await asyncio.sleep(0.05)


def chat_body(content: str = "hello", *, stream: bool = False, sim: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                            "stream": stream, **kw}
    if sim:
        body["sim"] = sim
    return body


class Held:
    """A request held open in the background (e.g. against a hanging engine) until cancelled."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self.first_chunk = asyncio.Event()
        self.result: httpx.Response | None = None
        self.body = b""
        self.ended_at: float | None = None  # loop time the exchange ended (in full or not)
        self._task = asyncio.get_running_loop().create_task(self._run(url, body, headers or {}))

    async def _run(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        # ``ended_at`` is set inside the task, not by a done callback: a callback runs one loop
        # step after the task ends, so a waiter finding the task already done could read None.
        try:
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", url, json=body, headers=headers) as r:
                    self.result = r
                    parts = []
                    async for part in r.aiter_raw():
                        parts.append(part)
                        self.first_chunk.set()
                    self.body = b"".join(parts)
        finally:
            self.ended_at = asyncio.get_running_loop().time()

    def failed(self) -> BaseException | None:
        """The exception that ended the request early, if it did."""
        if self._task.done() and not self._task.cancelled():
            return self._task.exception()
        return None

    async def finished(self) -> httpx.Response:
        await self._task
        assert self.result is not None
        return self.result

    async def cancel(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def counter(snap: dict[str, Any], outcome: str, reason: str) -> int:
    return sum(r["count"] for r in snap["counters_by_reason"] if r["outcome"] == outcome and r["reason"] == reason)


def balanced(snap: dict[str, Any]) -> bool:
    return unbalanced(snap["counters"]) == 0 and not any(snap["gauges"].values())


@asynccontextmanager
async def without_engine(base: str, engine: dict[str, Any]) -> AsyncIterator[None]:
    """Deregister ``engine`` at run time (admin API) and register it again afterwards."""
    async with httpx.AsyncClient(base_url=base, timeout=30, headers=ADMIN) as c:
        r = await c.request("DELETE", "/admin/engines", json={"name": engine["name"]})
        assert r.status_code == 200 and r.json()["result"] is True
        try:
            yield
        finally:
            assert (await c.post("/admin/engines", json=engine)).status_code == 200
    await wait_status(base, lambda s: any(e["name"] == engine["name"] and e["eligible"] for e in s["engines"]),
                      f"{engine['name']} to be eligible again")
