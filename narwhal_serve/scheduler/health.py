"""The scheduler's side of passive engine health: failed attempts reported by ingress replicas
feed each engine's breaker (:mod:`narwhal_serve.placement.health`), and an engine whose breaker
has been open its full period gets one probe request of the scheduler's own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import httpx

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.health import may_open
from narwhal_serve.relay.messages import EngineFault
from narwhal_serve.scheduler.monitor import probe_one


def apply_faults(engines: dict[str, EngineState], faults: Iterable[EngineFault], now: float, cfg: NarwhalConfig) -> None:
    """Count failed attempts against their engines' breakers, and start backpressure windows —
    never taking more engines out of work (breaker open or pushing back) than the fleet can spare:
    :func:`~narwhal_serve.placement.health.may_open`."""
    for f in faults:
        if (e := engines.get(f.engine)) is not None:
            open_now = sum(1 for x in engines.values() if not x.breaker.takes_work(now))
            spare = may_open(open_now, len(engines), cfg.monitoring)
            e.breaker.on_fault(f.kind, now, cfg.monitoring, f.retry_after_s, f.why, may_open=spare)


class Prober:
    """Probes of engines whose breaker is open: at most one in flight per engine."""

    def __init__(self, cfg: NarwhalConfig, clock: Callable[[], float], on_closed: Callable[[], None]) -> None:
        self.cfg = cfg
        self.clock = clock
        self.on_closed = on_closed  # called when a probe closed a breaker (queued requests may fit)
        self.tasks: set[asyncio.Task[None]] = set()

    def start_due(self, engines: Iterable[EngineState], client: httpx.AsyncClient) -> None:
        now = self.clock()
        for e in engines:
            if e.breaker.probe_due(now):
                task = asyncio.get_running_loop().create_task(self._probe(e, client))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _probe(self, e: EngineState, client: httpx.AsyncClient) -> None:
        timeout = self.cfg.serving.first_token_limit(self.cfg.admission.ttft_budget_s)
        ok, why = await probe_one(client, e, self.cfg.model, timeout)
        e.breaker.on_probe(ok, self.clock(), self.cfg.monitoring, why)
        if ok:
            self.on_closed()

    def cancel(self) -> None:
        for t in list(self.tasks):
            t.cancel()
