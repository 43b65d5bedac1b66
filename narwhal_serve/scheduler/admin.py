"""The scheduler's admin operations (docs/operations.md): router mode, drain, maintenance waves,
engines registered at run time and managed engines' replicas, readiness."""

from __future__ import annotations

import asyncio

from narwhal_serve.config import EngineConfig
from narwhal_serve.managed.slot import ReplicaReport
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.scheduler.monitor import scrape_one
from narwhal_serve.scheduler.queueing import AdmissionDesk


class AdminOps(AdmissionDesk):
    """What an operator (``/admin/*``) and managed engines' replicas change."""

    def set_mode(self, mode: str) -> None:
        if mode not in ("active", "standby", "fenced", "monitoring_degraded"):
            raise ValueError(f"unknown router mode {mode!r}")
        if self.ha.lease is not None:
            raise ValueError("with ha.lease.backend: redis the lease decides the router's mode")
        if mode == "active" and self.router.drain_until is not None:  # (found by a hostile probe: it said ok)
            raise ValueError("the router is draining: a drain stops admitting for good; start a new router")
        self.router.mode = mode  # type: ignore[assignment]
        self._pump()  # (what is queued is answered as a new request is)

    def drain(self, grace_s: float, now: float) -> float:
        """Stop admitting (503 ``router_unavailable``, reason ``draining``; ``/ready`` 503) and let
        the requests in flight finish; ``grace_s`` from now the ingress replicas end the streams
        still open with an error event.  Under a router lease, the lease is given up at once so
        that the standby takes over now, not after its TTL.  Returns the end of the grace period;
        a second call can only shorten it."""
        until = now + max(0.0, grace_s)
        self.router.drain_until = until if self.router.drain_until is None else min(until, self.router.drain_until)
        self.ha.give_up()
        self._pump()  # (what is queued gets the drain's 503 now)
        return self.router.drain_until

    def maintenance(self, waves: list[str], on: bool) -> list[str]:
        """Engines of these waves take no new work; in-flight requests finish (``draining``)."""
        unknown = sorted(set(waves) - {e.cfg.wave for e in self.engines.values()})
        if on and unknown:
            raise ValueError(f"unknown wave(s) {unknown}; engines are in {sorted({e.cfg.wave for e in self.engines.values()})}")
        self.views_stale()
        if on:
            self.router.maintenance.update(waves)
        else:
            self.router.maintenance.difference_update(waves)
        return sorted(self.router.maintenance)

    def register_managed(self, rep: ReplicaReport) -> str:
        """A managed engine's replica reports its engine up (first, after a restart, or as its
        heartbeat); a changed engine is scraped at once, so it rejoins without waiting a pass."""
        name, changed = self.managed.register(rep, self.clock())
        self.views_stale()
        if changed:
            self._scrape_soon(name)
            e = self.engines.get(name)
            if e is not None and self._monitor is not None:
                self.kv_events.restart(e)  # a new process: new sockets, a new cache
        return name

    def managed_down(self, engine: str, replica: str, reason: str) -> None:
        name = self.managed.down(engine, replica, reason, self.clock())
        if name is not None and name not in self.engines:  # an extra slot, gone with its replica
            self.kv_events.drop(name)
        self.views_stale()

    def _scrape_soon(self, name: str) -> None:
        async def scrape() -> None:
            if (e := self.engines.get(name)) is not None:
                await scrape_one(self.client(), e, self.clock(), self.cfg.monitoring.scrape_timeout_s)
                self.touch(name)
                self._pump()

        task = asyncio.get_running_loop().create_task(scrape())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def register_engine(self, engine: EngineConfig) -> None:
        if engine.launch is not None:
            raise ValueError("engines with a launch spec are started from the serve config; register a URL")
        if engine.name in self.engines:
            raise ValueError(f"engine {engine.name!r} is already registered")
        self.engines[engine.name] = e = EngineState(engine).configure(self.cfg)
        self.views_stale()
        if self._monitor is not None:
            self.kv_events.start([e])

    def deregister_engine(self, name: str) -> bool:
        self.kv_events.drop(name)
        self.views_stale()
        return self.engines.pop(name, None) is not None

    def readiness(self) -> tuple[bool, str]:
        """Judged on the facts decisions read and the next grant carries (not every engine read
        anew): a 200 from ``/ready`` is followed by admissions, not by a refusal until those facts
        catch up."""
        now = self.clock()
        view = self.decision_view(now)
        if view.unavailable is not None:
            return False, view.unavailable
        if not self.router.started:
            return False, "starting"
        if not view.eligible(now):
            return False, "no_eligible_engines"
        return True, "active"
