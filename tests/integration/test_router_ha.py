"""Router HA through the Ray graph: two Narwhal applications share one Redis lease (real Redis
server), monitoring going dark and back turns the router's state by itself, and a wave-by-wave
maintenance under steady load loses nothing.  The process-level failover (SIGSTOP, SIGKILL) is
tested without Ray in tests/unit/ha/test_failover_processes.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from narwhal_serve.config.sim import SimEngineConfig
from tests.integration.conftest import ADMIN, Graph
from tests.support.engine_host import EngineHost
from tests.support.graph import chat_body, wait_ready
from tests.support.redis_server import RedisServer

TTL, RENEW = 2.0, 0.4


@dataclass
class HaPair:
    a: str  # the router meant to be active (role active)
    b: str  # its standby (role standby)
    engines: dict[str, str]  # name -> URL (wave a: ha-u0, wave b: ha-u1)


def _args(host: EngineHost, redis_url: str, role: str, engines: dict[str, str]) -> dict[str, Any]:
    return {
        "model": "narwhal-sim",
        "admission": {"mode": "open"},
        "engines": [{"name": n, "url": u, "role": "unified", "wave": "a" if n.endswith("0") else "b"}
                    for n, u in engines.items()],
        "monitoring": {"scrape_interval_s": 0.2, "stale_after_s": 1.0, "scrape_timeout_s": 0.5},
        "ha": {"role": role, "lease": {"backend": "redis", "url": redis_url, "key": "narwhal:it",
                                       "ttl_s": TTL, "renew_s": RENEW}},
        "deployment": {"ingress_max_replicas": 1, "assembler_max_replicas": 1},
    }


@pytest.fixture(scope="module")
def ha(graph: Graph) -> Iterator[HaPair]:
    from ray import serve

    from deployments.app import build_app

    redis_server = RedisServer().start()
    host = EngineHost()
    try:
        engines = {n: host.start(SimEngineConfig(name=n, role="unified", tpot_base_s=0.02)) for n in ("ha-u0", "ha-u1")}
        serve.run(build_app(_args(host, redis_server.url, "active", engines)), name="ha-a", route_prefix="/ha-a")
        serve.run(build_app(_args(host, redis_server.url, "standby", engines)), name="ha-b", route_prefix="/ha-b")
        yield HaPair(graph.url + "/ha-a", graph.url + "/ha-b", engines)
    finally:
        for name in ("ha-a", "ha-b"):
            try:
                serve.delete(name)
            except Exception:
                pass
        host.close()
        redis_server.stop()


async def _status(c: httpx.AsyncClient, base: str) -> dict[str, Any]:
    r = await c.get(base + "/status")
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


async def _reason(c: httpx.AsyncClient, base: str) -> str | None:
    r = await c.get(base + "/ready")
    return None if r.status_code == 200 else str(r.json()["reason"])


async def _wait_reason(c: httpx.AsyncClient, base: str, want: str | None, timeout_s: float) -> float:
    t0 = time.monotonic()
    while (got := await _reason(c, base)) != want:
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{base}: /ready reason {got!r}, wanted {want!r} within {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_one_lease_one_active_router(ha: HaPair) -> None:
    await wait_ready(ha.a, 200, timeout=30)
    async with httpx.AsyncClient(timeout=30) as c:
        await _wait_reason(c, ha.b, "standby", 10)
        a, b = await _status(c, ha.a), await _status(c, ha.b)
        assert a["epoch"] and a["ha"]["mode"] == "active" and a["ha"]["holder"] == a["ha"]["holder_id"]
        assert b["epoch"] is None and b["ha"]["mode"] == "standby"
        r = await c.post(ha.a + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 200, r.text
        r = await c.post(ha.b + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and r.headers["x-narwhal-reason"] == "standby"
        assert r.json()["error"]["code"] == "router_unavailable" and r.headers["retry-after"] == "1"
        r = await c.post(ha.a + "/admin/state", json={"mode": "standby"}, headers=ADMIN)
        assert r.status_code == 400 and "lease decides" in r.json()["error"]["message"]


async def test_monitoring_going_dark_and_back_turns_the_state_by_itself(ha: HaPair) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        await _wait_reason(c, ha.a, None, 10)
        for url in ha.engines.values():  # /metrics hangs: the router cannot see the engines any more
            assert (await c.post(url + "/sim/control", json={"faults": ["stale_metrics"]})).status_code == 200
        try:
            await _wait_reason(c, ha.a, "monitoring_degraded", 10)
            r = await c.post(ha.a + "/v1/chat/completions", json=chat_body())
            assert r.status_code == 503 and r.headers["x-narwhal-reason"] == "monitoring_degraded"
            assert "fresh data from 0 of 2" in (await _status(c, ha.a))["ha"]["monitoring_degraded"]
        finally:
            for url in ha.engines.values():
                await c.post(url + "/sim/control", json={"faults": []})
        await _wait_reason(c, ha.a, None, 10)  # data is fresh again: active, without a restart
        # (/ready judges on the facts decisions read: the request after its 200 is admitted)
        r = await c.post(ha.a + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 200, r.text


class Load:
    """Closed-loop streaming clients; every answer is kept."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.results: list[tuple[int, str]] = []
        self.stop = asyncio.Event()
        self.tasks = [asyncio.ensure_future(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            while not self.stop.is_set():
                r = await c.post(self.url + "/v1/chat/completions", json=chat_body(stream=True, max_tokens=12))
                self.results.append((r.status_code, r.text))

    async def finish(self) -> list[tuple[int, str]]:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        return self.results


async def _drained(c: httpx.AsyncClient, base: str, engine: str, timeout_s: float = 15.0) -> dict[str, Any]:
    t0 = time.monotonic()
    while True:
        e = {v["name"]: v for v in (await _status(c, base))["engines"]}[engine]
        if e["maintenance"] and not e["draining"] and e["inflight"] == 0:
            return e
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{engine} never drained: {e}")
        await asyncio.sleep(0.05)


async def test_wave_by_wave_maintenance_under_steady_load_loses_nothing(ha: HaPair) -> None:
    async with httpx.AsyncClient(timeout=30, headers=ADMIN) as c:
        await _wait_reason(c, ha.a, None, 10)
        load = Load(ha.a, 4)
        try:
            for wave, engine in (("a", "ha-u0"), ("b", "ha-u1")):
                while len(load.results) < 8:  # both engines busy before each wave goes down
                    await asyncio.sleep(0.05)
                r = await c.post(ha.a + "/admin/maintenance", json={"waves": [wave]})
                assert r.status_code == 200 and r.json()["result"] == [wave]
                await _drained(c, ha.a, engine)
                before = (await c.get(ha.engines[engine] + "/sim/stats")).json()["total_requests"]
                n = len(load.results)
                while len(load.results) < n + 8:  # the load goes on, elsewhere
                    await asyncio.sleep(0.05)
                after = (await c.get(ha.engines[engine] + "/sim/stats")).json()["total_requests"]
                assert after == before, f"{engine} took new work while in maintenance"
                r = await c.request("DELETE", ha.a + "/admin/maintenance", json={"waves": [wave]})
                assert r.status_code == 200 and r.json()["result"] == []
            r = await c.post(ha.a + "/admin/maintenance", json={"waves": ["zz"]})
            assert r.status_code == 400 and "unknown wave" in r.json()["error"]["message"]
        finally:
            results = await load.finish()
    bad = [(s, t[-300:]) for s, t in results if s != 200 or not t.endswith("data: [DONE]\n\n") or '"error"' in t]
    assert not bad, f"{len(bad)} of {len(results)} requests failed during maintenance: {bad[:3]}"
    assert len(results) >= 24


async def test_the_standby_takes_over_when_the_active_stops(ha: HaPair) -> None:
    from ray import serve

    async with httpx.AsyncClient(timeout=30) as c:
        await _wait_reason(c, ha.a, None, 10)
        first = (await _status(c, ha.a))["epoch"]
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, serve.delete, "ha-a")
        await _wait_reason(c, ha.b, None, TTL + RENEW + 10)
        took = time.monotonic() - t0
        snap = await _status(c, ha.b)
        assert snap["epoch"] > first and snap["ha"]["holder"] == snap["ha"]["holder_id"]
        r = await c.post(ha.b + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 200, r.text
        print(json.dumps({"standby_active_after_delete_s": round(took, 2)}))
