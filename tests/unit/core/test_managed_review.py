"""Review of managed engines (narwhal_serve/managed, narwhal_serve/scheduler/managed.py): each test
shows one bug; it fails now and passes once the bug is fixed.  No Ray, no real engines: the
scheduler's bookkeeping with a mock transport, and small bounded processes (sleep) for the process
side."""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.managed.process import EngineDown, EngineProcess
from narwhal_serve.managed.slot import ReplicaReport
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from narwhal_serve.scheduler.service import SchedulerService
from tests.support.scheduler import Clock
from tests.unit.core.test_managed_fleet import engine_transport

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, prctl")



# --- the scheduler's bookkeeping (as tests/unit/core/test_managed_fleet.py sets it up) -------------

def _fleet(engines: list[dict[str, object]]) -> tuple[SchedulerService, Clock, set[str]]:
    clock = Clock()
    svc = SchedulerService(NarwhalConfig.model_validate({"engines": engines}), clock=clock)
    down: set[str] = set()
    svc._client = httpx.AsyncClient(transport=engine_transport(down))
    svc.router.started = True
    return svc, clock, down


def _report(replica: str, port: int, engine: str = "m") -> ReplicaReport:
    return ReplicaReport(engine=engine, replica=replica, url=f"http://10.0.0.1:{port}", node_id="node-a",
                         node_ip="10.0.0.1", accelerator_ids=(), pid=1000 + port, log=f"/tmp/{replica}.log",
                         ready_s=1.0)


async def _settle(svc: SchedulerService) -> None:
    while svc._background:
        await asyncio.gather(*list(svc._background))


def _managed_names(svc: SchedulerService) -> list[str]:
    return [n for n, e in svc.engines.items() if e.managed is not None]


async def test_late_heartbeat_of_a_replica_already_down_does_not_make_a_ghost_slot() -> None:
    """scheduler/managed.py:48-72 register(): a replica's heartbeat sent just before its engine died can
    reach the scheduler after its ``managed_down`` (Serve gives no order between two calls).  Once
    the replacement holds the slot, nothing remembers that this replica is gone: the late beat
    finds no slot of its own, every slot is held, so it gets a new extra slot, state ``up``, at
    the dead engine's URL -- and no ``managed_down`` will ever come for it (the replica already
    sent its one), so the ghost stays in the fleet for good.  (test_managed_fleet: "a late
    heartbeat of the dying replica does not revive it".)"""
    svc, clock, down = _fleet([{"name": "m", "role": "unified", "launch": {"kind": "sim"}}])
    svc.register_managed(_report("r1", 8001))
    await _settle(svc)
    down.add("10.0.0.1:8001")
    svc.managed_down("m", "r1", "engine m (pid 9001) was killed by SIGKILL")
    clock.t += 8
    assert svc.register_managed(_report("r2", 8002)) == "m"  # the replacement takes the slot over
    await _settle(svc)
    svc.register_managed(_report("r1", 8001))  # r1's beat, sent before its engine died, arrives now
    await _settle(svc)
    assert _managed_names(svc) == ["m"], "a replica that reported its engine down was given a slot again"
    assert all(e.managed is not None and e.managed.report is not None and e.managed.report.replica != "r1"
               for e in svc.engines.values() if e.managed is not None and e.managed.up)


async def test_an_extra_slot_never_takes_the_name_of_a_configured_engine() -> None:
    """scheduler/managed.py:66-71: an extra slot (a replacement replica registering while the
    old one still runs: a redeploy) is named ``<name>-<k>`` without looking whether that name is
    taken.  The config accepts a URL engine named ``m-1`` beside a managed ``m`` (replicas 1: its
    only slot is ``m``), so the extra slot replaces that engine's state in the fleet (its URL, its
    in-flight count), and ``managed_down`` of the extra replica then deletes ``m-1`` from the
    fleet altogether: the operator's engine is gone until the scheduler restarts."""
    svc, clock, _ = _fleet([{"name": "m", "role": "unified", "launch": {"kind": "sim"}},
                            {"name": "m-1", "url": "http://10.0.0.9:8000", "role": "unified"}])
    svc.engines["m-1"].inflight = 3  # requests in flight on the URL engine
    svc.register_managed(_report("r1", 8001))
    svc.register_managed(_report("r2", 8002))  # a redeploy: the new replica before the old one stops
    await _settle(svc)
    url_engine = svc.engines.get("m-1")
    assert url_engine is not None and url_engine.managed is None and url_engine.cfg.url == "http://10.0.0.9:8000", \
        "the extra slot of m took the place of the configured engine m-1"
    assert url_engine.inflight == 3
    svc.managed_down("m", "r2", "stopped with its replica")
    assert "m-1" in svc.engines, "the configured URL engine m-1 left the fleet with m's extra replica"


async def test_an_extra_slot_that_went_down_with_requests_in_flight_leaves_once_they_end() -> None:
    """scheduler/managed.py:103-104: an extra slot leaves with its replica only if nothing is in
    flight on it at that moment; with a request still in flight it stays, and nothing removes it
    once that request ends (no hook in the release, none in the monitor pass): a ``down`` engine
    in /status and /metrics, and its KV-event feed kept, for the scheduler's life (module doc:
    "an extra slot until one of them goes down"; docs/operations.md: "A managed engine's extra
    slot that leaves with its replica is no longer followed")."""
    svc, clock, down = _fleet([{"name": "m", "role": "unified", "launch": {"kind": "sim"}}])
    svc.register_managed(_report("r1", 8001))
    svc.register_managed(_report("r2", 8002))  # the extra slot m-1
    await _settle(svc)
    assert _managed_names(svc) == ["m", "m-1"]
    down.add("10.0.0.1:8001")  # only m-1 takes work
    await svc.scrape_once()
    res = await svc.admit(AdmitRequest("t1", clock.t + 100, 10, 16, 2.0))
    assert "m-1" in {n for route in res.candidates for n in route.engines}, res
    assert svc.engines["m-1"].inflight == 1
    svc.managed_down("m", "r2", "stopped with its replica")  # its replica stops, the request still running
    svc.report(Report(released=[("t1", None, False)]))  # the request ends (cut)
    assert svc.engines["m-1"].inflight == 0  # released: nothing holds the slot any more
    clock.t += 1
    await svc.scrape_once()
    clock.t += 60
    await svc.scrape_once()
    assert "m-1" not in svc.engines, "the extra slot outlived its replica and its last request"


# --- the engine process ---------------------------------------------------------------------------

@linux_only
async def test_an_engine_killed_by_a_realtime_signal_is_described_not_a_crash(tmp_path: Path) -> None:
    """managed/process.py:76: ``signal.Signals(-rc)`` raises ValueError for signals the enum does
    not name (32, 33, 35..63: SIGRTMIN+1 … SIGRTMAX-1).  An engine killed by one makes
    describe_exit() raise, so the replica's _watch task (deployments/engine.py:145) dies before it
    stops the rest of the process group and before it tells the scheduler (the dead engine keeps
    its slot ``up`` until a scrape fails), and check() raises ValueError, not EngineDown."""
    proc = EngineProcess("rt", ["sleep", "30"], dict(os.environ), tmp_path / "rt.log")
    await proc.start()
    try:
        os.kill(proc.pid or 0, signal.SIGRTMIN + 6)
        assert await asyncio.wait_for(proc.wait_exit(), 10) == -(signal.SIGRTMIN + 6)
        why = proc.describe_exit()  # ValueError: 40 is not a valid Signals
        assert str(int(signal.SIGRTMIN + 6)) in why
        with pytest.raises(EngineDown):
            await proc.check("http://127.0.0.1:9", timeout_s=1)
    finally:
        await proc.stop(grace_s=1)


class _Health(http.server.BaseHTTPRequestHandler):
    """An engine whose /health answers 200."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@linux_only
async def test_readiness_and_health_ask_the_engine_not_a_proxy_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """managed/process.py:100: the replica's client is ``httpx.AsyncClient`` with its default
    ``trust_env=True``: on a node whose environment has HTTP_PROXY / ALL_PROXY (as clusters that
    download models through a proxy do) and a NO_PROXY that does not list the node's own address,
    /health of the engine (http://<node ip>:<port>) is asked of the proxy -- the engine is never
    judged ready (or is judged by the proxy's answer), and Serve's health checks fail.  Readiness
    is "the engine's /health answers 200" (docs/operations.md, "Managed engines")."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # a proxy that refuses (bound, not listening)
    try:
        for k in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead.getsockname()[1]}")
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{dead.getsockname()[1]}")
        proc = EngineProcess("proxied", ["sleep", "30"], dict(os.environ), tmp_path / "p.log")
        await proc.start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            await proc.wait_ready(url, timeout_s=3, every_s=0.2)  # EngineStartError: ConnectError (the proxy)
            await proc.check(url, timeout_s=2)
        finally:
            await proc.stop(grace_s=1)
    finally:
        dead.close()
        server.shutdown()
        server.server_close()

