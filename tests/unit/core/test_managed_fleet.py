"""The scheduler's bookkeeping of managed engines: slots, registration, heartbeats, a process that
dies, the replica that replaces it, and what /status and /metrics show.  No Ray, no sockets."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.managed.slot import STALE_AFTER_S, ReplicaReport
from narwhal_serve.scheduler.service import SchedulerService
from tests.support.scheduler import Clock

METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


def engine_transport(down: set[str]) -> httpx.MockTransport:
    """Every engine answers /health and /metrics, except those whose host:port is in ``down``."""

    def handler(request: httpx.Request) -> httpx.Response:
        if f"{request.url.host}:{request.url.port}" in down:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text=METRICS if request.url.path == "/metrics" else "")

    return httpx.MockTransport(handler)


def fleet(replicas: int = 1) -> tuple[SchedulerService, Clock, set[str]]:
    clock = Clock()
    cfg = NarwhalConfig.model_validate({"engines": [
        {"name": "m", "role": "unified", "launch": {"kind": "sim", "replicas": replicas}},
        {"name": "u", "url": "http://127.0.0.1:9", "role": "unified"},
    ]})
    svc = SchedulerService(cfg, clock=clock)
    down: set[str] = set()
    svc._client = httpx.AsyncClient(transport=engine_transport(down))
    svc.router.started = True
    return svc, clock, down


def report(replica: str, port: int, node: str = "node-a", engine: str = "m") -> ReplicaReport:
    return ReplicaReport(engine=engine, replica=replica, url=f"http://10.0.0.1:{port}", node_id=node,
                         node_ip="10.0.0.1", accelerator_ids=("0",), pid=1000 + port, log=f"/tmp/{replica}.log",
                         ready_s=1.5)


async def settle(svc: SchedulerService) -> None:
    while svc._background:
        await asyncio.gather(*list(svc._background))


def eligible(svc: SchedulerService, name: str) -> bool:
    return svc.engines[name].eligible(svc.clock(), svc.cfg.monitoring.stale_after_s, frozenset())


def status(svc: SchedulerService, name: str) -> dict[str, object]:
    return next(e for e in svc.snapshot()["engines"] if e["name"] == name)


async def test_slots_start_ineligible_then_register_scrape_and_serve() -> None:
    svc, _, _ = fleet()
    assert list(svc.engines) == ["m", "u"]
    await svc.scrape_once()
    view = status(svc, "m")
    assert view["managed"] is True and view["url"] == "" and not view["eligible"]
    assert view["placement"]["state"] == "starting"  # type: ignore[index]
    assert svc.engines["m"].answered(svc.clock(), 5.0)  # known down, not a silent engine
    assert status(svc, "u")["managed"] is False and status(svc, "u")["placement"] is None

    assert svc.register_managed(report("r1", 8001)) == "m"
    await settle(svc)  # scraped at once: eligible without waiting for the monitor's next pass
    assert eligible(svc, "m")
    p = status(svc, "m")["placement"]
    assert status(svc, "m")["url"] == "http://10.0.0.1:8001"
    assert p["state"] == "up" and p["node_id"] == "node-a" and p["accelerator_ids"] == ["0"]  # type: ignore[index]
    assert p["replica"] == "r1" and p["pid"] == 9001 and p["restarts"] == 0  # type: ignore[index]
    routes = svc.view(svc.clock()).engines
    assert [e.cfg.url for e in routes if e.cfg.name == "m"] == ["http://10.0.0.1:8001"]
    assert all(e.cfg.launch is None for e in routes)  # the fleet's views (sent to every ingress) stay small


async def test_heartbeat_is_idempotent_and_a_dead_process_is_ineligible_at_once() -> None:
    svc, clock, down = fleet()
    svc.register_managed(report("r1", 8001))
    await settle(svc)
    svc.engines["m"].inflight = 2  # requests in flight on it
    clock.t += 5
    svc.register_managed(report("r1", 8001))  # heartbeat: nothing changes, no scrape
    assert not svc._background and eligible(svc, "m")
    assert status(svc, "m")["placement"]["heartbeat_age_s"] == 0.0  # type: ignore[index]

    down.add("10.0.0.1:8001")
    svc.managed_down("m", "r1", "engine m (pid 9001) was killed by SIGKILL")
    assert not eligible(svc, "m")
    p = status(svc, "m")["placement"]
    assert p["state"] == "down" and "SIGKILL" in p["last_exit"]  # type: ignore[index]
    svc.register_managed(report("r1", 8001))  # a late heartbeat of the dying replica does not revive it
    assert not eligible(svc, "m")

    # Ray's replacement replica: a new process on a new port takes the slot over
    clock.t += 1
    assert svc.register_managed(report("r2", 8002, node="node-b")) == "m"
    await settle(svc)
    assert eligible(svc, "m")
    p = status(svc, "m")["placement"]
    assert p["replica"] == "r2" and p["node_id"] == "node-b" and p["restarts"] == 1  # type: ignore[index]
    assert svc.engines["m"].inflight == 2  # in-flight requests still release against the same name
    svc.managed_down("m", "r1", "stopped with its replica")  # the old replica's late goodbye
    assert eligible(svc, "m")


async def test_replicas_fill_slots_and_a_silent_holder_gives_its_slot_up() -> None:
    svc, clock, _ = fleet(replicas=2)
    assert [n for n in svc.engines if n != "u"] == ["m-0", "m-1"]
    assert svc.register_managed(report("r1", 8001)) == "m-0"
    assert svc.register_managed(report("r2", 8002)) == "m-1"
    # a third replica while both are alive (Serve starts a replacement before the old one stops)
    assert svc.register_managed(report("r3", 8003)) == "m-2"
    svc.managed_down("m", "r3", "stopped with its replica")
    assert "m-2" not in svc.engines  # the extra slot leaves with its replica
    # r1 went silent (its replica was killed outright): after the stale window a new replica takes it
    clock.t += STALE_AFTER_S + 1
    svc.register_managed(report("r2", 8002))
    assert svc.register_managed(report("r4", 8004)) == "m-0"
    await settle(svc)
    assert status(svc, "m-0")["placement"]["replica"] == "r4"  # type: ignore[index]


async def test_a_restarted_scheduler_relearns_from_heartbeats() -> None:
    svc, _, _ = fleet()
    svc.register_managed(report("r1", 8001))
    fresh = SchedulerService(svc.cfg, clock=svc.clock)
    fresh._client = svc._client
    assert fresh.register_managed(report("r1", 8001)) == "m"
    await settle(fresh)
    assert eligible(fresh, "m")


async def test_unknown_engines_and_admin_registration_of_launch_specs_are_refused() -> None:
    svc, _, _ = fleet()
    with pytest.raises(ValueError, match="unknown managed engine 'x'"):
        svc.register_managed(report("r1", 8001, engine="x"))
    spec = EngineConfig.model_validate({"name": "n", "launch": {"kind": "sim"}})
    with pytest.raises(ValueError, match="started from the serve config"):
        svc.register_engine(spec)


async def test_metrics_show_where_engines_run() -> None:
    svc, _, _ = fleet()
    svc.register_managed(report("r1", 8001))
    svc.register_managed(replace(report("r1", 8001), ready_s=1.5))
    await settle(svc)
    text = svc.metrics_text()
    assert ('narwhal_engine_info{engine="m",managed="true",state="up",node_id="node-a",node_ip="10.0.0.1",'
            'replica="r1"} 1') in text
    assert 'narwhal_engine_info{engine="u",managed="false",state="",node_id="",node_ip="",replica=""} 1' in text
    assert 'narwhal_engine_restarts_total{engine="m"} 0' in text
    families = {f.name for f in text_string_to_metric_families(text)}  # valid exposition format
    assert {"narwhal_engine_info", "narwhal_engine_restarts"} <= families


async def test_a_managed_engines_kv_events_are_followed_and_a_new_replica_is_resubscribed() -> None:
    """The replica reports its engine's KV-event sockets; the scheduler subscribes, and subscribes
    anew (index cleared) when a new replica with new sockets takes the slot.  (Publishing and the
    index itself: tests/unit/kvevents.)"""
    from narwhal_serve.sim.kvevents import SimKVPublisher
    from narwhal_serve.sim.timing import block_hashes
    from tests.support.net import free_port

    svc, _, _ = fleet()
    svc._monitor = asyncio.get_running_loop().create_future()  # type: ignore[assignment]  # "started"
    ends = [(f"ipc:///tmp/narwhal-test-kv-{free_port()}", f"ipc:///tmp/narwhal-test-kv-{free_port()}") for _ in range(2)]
    pubs = [SimKVPublisher(*e) for e in ends]
    try:
        svc.register_managed(replace(report("r1", 8001), kv_events=ends[0]))
        await settle(svc)
        e = svc.engines["m"]
        assert e.prefix_exact and svc.kv_events.view("m") is not None
        ids = list(range(64))
        for _ in range(100):  # (the subscription joins asynchronously)
            pubs[0].publish([pubs[0].stored(block_hashes(ids, 16), None, ids, 16)])
            await asyncio.sleep(0.02)
            if len(e.prefix):
                break
        assert len(e.prefix) == 1  # one 64-token router block
        svc.managed_down("m", "r1", "exited")
        assert svc.register_managed(replace(report("r2", 8002), kv_events=ends[1])) == "m"  # its replacement
        await settle(svc)
        await asyncio.sleep(0.05)
        assert len(e.prefix) == 0 and svc.kv_events.view("m")["endpoint"] == ends[1][0]  # type: ignore[index]
    finally:
        svc._monitor = None
        await svc.kv_events.stop()
        for p in pubs:
            p.close()
