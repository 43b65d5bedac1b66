"""Two routers (each a process: scheduler, gateway and its simulated engine, no Ray) share one
lease on a real Redis server: the standby takes over when the active is paused or killed, and a
paused active that resumes is fenced — it admits nothing, never under its old epoch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.redis_server import RedisServer

TTL, RENEW = 2.0, 0.4
BODY = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class Router:
    proc: subprocess.Popen[str]
    url: str
    sim_url: str

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


def start_router(redis_url: str, role: str) -> Router:
    args = {
        "ha": {"role": role, "lease": {"backend": "redis", "url": redis_url, "key": "narwhal:failover",
                                       "ttl_s": TTL, "renew_s": RENEW}},
        "admission": {"mode": "open"},
        "monitoring": {"scrape_interval_s": 0.2},
        "sim": {"engines": [{"name": f"{role}-u", "role": "unified"}]},
    }
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.local_router_main", json.dumps(args)],
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by the per-test timeout
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"router did not start: {line!r}")
    _, url, sim_url = line.split()
    return Router(proc, url, sim_url)


@pytest.fixture
def routers() -> Iterator[tuple[RedisServer, Router, Router]]:
    redis_server = RedisServer().start()
    a = start_router(redis_server.url, "active")
    b = start_router(redis_server.url, "standby")
    try:
        yield redis_server, a, b
    finally:
        for r in (a, b):
            r.signal(signal.SIGCONT)
            r.signal(signal.SIGKILL)
            r.proc.wait(10)
        redis_server.stop()


async def ready(c: httpx.AsyncClient, r: Router) -> tuple[int, dict[str, Any]]:
    resp = await c.get(r.url + "/ready")
    out: dict[str, Any] = resp.json()
    return resp.status_code, out


async def wait_ready(c: httpx.AsyncClient, r: Router, status: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while True:
        got, body = await ready(c, r)
        if got == status:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{r.url} /ready stayed {got} {body} for {timeout_s} s")
        await asyncio.sleep(0.05)


async def epoch(c: httpx.AsyncClient, r: Router) -> int | None:
    e: int | None = (await c.get(r.url + "/status")).json()["epoch"]
    return e


async def engine_requests(c: httpx.AsyncClient, r: Router) -> int:
    n: int = (await c.get(r.sim_url + "/sim/stats")).json()["total_requests"]
    return n


async def test_pause_fences_the_active_and_the_standby_takes_over(routers: tuple[RedisServer, Router, Router]) -> None:
    _, a, b = routers
    async with httpx.AsyncClient(timeout=10) as c:
        await wait_ready(c, a, 200, 10)
        status, body = await ready(c, b)
        assert status == 503 and body["reason"] == "standby"
        r = await c.post(b.url + "/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "router_unavailable"
        assert r.headers["retry-after"] == "1" and r.headers["x-narwhal-reason"] == "standby"
        assert (await c.post(a.url + "/v1/chat/completions", json=BODY)).status_code == 200
        first = await epoch(c, a)
        assert first is not None and await epoch(c, b) is None
        for _ in range(100):  # the standby hint waits one renewal before its first try
            ha = (await c.get(b.url + "/status")).json()["ha"]
            if ha["holder"]:
                break
            await asyncio.sleep(0.05)
        assert ha["mode"] == "standby" and ha["holder"] and ha["holder"] != ha["holder_id"]
        served_by_a = await engine_requests(c, a)

        a.signal(signal.SIGSTOP)  # the active's scheduler stops: no renewals, no answers
        took = await wait_ready(c, b, 200, TTL + RENEW + 3)
        print(f"failover after a pause: {took:.2f} s (ttl {TTL}, renew {RENEW})")
        assert took <= TTL + RENEW + 1.0, f"failover took {took:.2f} s"
        second = await epoch(c, b)
        assert second is not None and second > first
        assert (await c.post(b.url + "/v1/chat/completions", json=BODY)).status_code == 200

        a.signal(signal.SIGCONT)  # resumed past its lease: it must refuse, whatever its old view
        answers = await asyncio.gather(*(c.post(a.url + "/v1/chat/completions", json=BODY) for _ in range(8)))
        for resp in answers:
            assert resp.status_code == 503, resp.text
            assert resp.headers["x-narwhal-reason"] in ("fenced", "standby")
        assert await engine_requests(c, a) == served_by_a  # nothing reached its engine after the pause
        await wait_ready(c, a, 503, 5)
        status, body = await ready(c, a)
        assert body["reason"] in ("fenced", "standby")
        assert await epoch(c, a) is None

        b.signal(signal.SIGKILL)  # the new active dies: the old one takes over again, with a new epoch
        took = await wait_ready(c, a, 200, TTL + RENEW + 3)
        print(f"failover after a kill: {took:.2f} s")
        assert took <= TTL + RENEW + 1.0
        third = await epoch(c, a)
        assert third is not None and third > second
