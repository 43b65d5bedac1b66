"""The scheduler: single source of truth for engines, router state, admission and counters.

Plain asyncio, no Ray: the Ray deployment (``deployments/scheduler.py``) only forwards calls here,
and tests drive it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from narwhal_serve.admission.controller import AdmissionController, Enqueued, Grant, Refusal
from narwhal_serve.admission.counters import Counters
from narwhal_serve.admission.outcomes import Outcome
from narwhal_serve.admission.predictive import judge
from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.errors import ErrorInfo, NarwhalError
from narwhal_serve.ha.state import RouterState, backend_unavailable, router_unavailable
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.picker import candidate_routes
from narwhal_serve.prediction.ttft import Projection, project, slot_wait_s
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report
from narwhal_serve.relay.messages import RelayStats
from narwhal_serve.scheduler.monitor import scrape_all
from narwhal_serve.telemetry import TPOT_BUCKETS, Histogram, render_metrics

@dataclass
class _Placement:
    engines: tuple[str, ...]
    first_engine: str | None  # the engine whose prefill gives the first token
    prompt_tokens: int
    x_tokens: int  # prefill tokens at that engine, this prompt included, when admitted
    predicted_s: float | None
    slot_wait_s: float = 0.0  # the queueing part of the prediction
    prefill_done: bool = False


_CANCELLED = NarwhalError("the client went away while waiting for admission", code="cancelled").info()
_TOMBSTONES = 4096


class SchedulerService:
    def __init__(self, cfg: NarwhalConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.admission = AdmissionController(cfg.admission, cfg.serving)
        self.engines: dict[str, EngineState] = {e.name: EngineState(e) for e in cfg.resolved_engines()}
        self.router = RouterState(mode="standby" if cfg.ha.role == "standby" else "active")
        self.counters = Counters()
        self.histograms = {
            "ttft": Histogram(),
            "tpot": Histogram(TPOT_BUCKETS),
            "admission_wait": Histogram(),
            "ttft_prediction_error": Histogram(),
        }
        self._waiters: dict[str, asyncio.Future[AdmitResult]] = {}
        self._routes: dict[str, _Placement] = {}  # ticket -> what its admission counted
        self._queued_tokens = 0
        self._queued_prompt: dict[str, int] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._rotation = 0
        self._client: httpx.AsyncClient | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._monitor is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.monitoring.scrape_timeout_s)
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop())

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self._client is not None:
            await self._client.aclose()

    async def _monitor_loop(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.cfg.monitoring.scrape_interval_s)

    async def scrape_once(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.monitoring.scrape_timeout_s)
        await scrape_all(
            self._client, list(self.engines.values()), self.clock(), self.cfg.monitoring.scrape_timeout_s
        )
        self.router.started = True
        self._pump()  # engines may have become eligible for queued requests

    # -- admission ---------------------------------------------------------------------------
    def _eligible(self, now: float) -> list[EngineState]:
        maint = frozenset(self.router.maintenance)
        stale = self.cfg.monitoring.stale_after_s
        return [e for e in self.engines.values() if e.eligible(now, stale, maint)]

    def _routes_now(self, now: float) -> list[RouteChoice]:
        self._rotation += 1
        return candidate_routes(self._eligible(now), self._rotation)

    def _refuse(self, refusal: Refusal) -> AdmitResult:
        self.counters.add(refusal.outcome, refusal.reason)
        return AdmitResult(error=refusal.error)

    def _refuse_info(self, err: ErrorInfo, outcome: Outcome) -> AdmitResult:
        self.counters.add(outcome, err.code)
        return AdmitResult(error=err)

    def _first_token_engine(self, route: RouteChoice) -> EngineState | None:
        return self.engines.get(route.prefill.name if route.prefill else route.decode.name)

    def _slot_wait(self, route: RouteChoice) -> float:
        d = self.engines.get(route.decode.name)
        return 0.0 if d is None else slot_wait_s(d.in_flight(), d.slots(), d.service_s)

    def _predict(self, route: RouteChoice, prompt_tokens: int) -> Projection | None:
        e = self._first_token_engine(route)
        if e is None:
            return None
        pending = e.pending_prefill_tokens + self._queued_tokens
        return project(e.ttft_model, pending, prompt_tokens, self._slot_wait(route))

    def _rank_predictive(self, routes: list[RouteChoice], req: AdmitRequest) -> tuple[list[RouteChoice], Refusal | None]:
        """Best projected route first; the refusal when even the best one misses the budget."""
        scored = [(p.projected_s if p else float("inf"), i, r, p)
                  for i, (r, p) in enumerate((r, self._predict(r, req.prompt_tokens)) for r in routes)]
        scored.sort(key=lambda s: (s[0], s[1]))
        best = scored[0][3]
        refusal = judge(best, req.ttft_budget_s) if best is not None else None
        return [s[2] for s in scored], refusal

    def _placed(self, ticket_id: str, routes: list[RouteChoice], prompt_tokens: int) -> AdmitResult:
        route = routes[0]
        for name in route.engines:
            if name in self.engines:
                self.engines[name].inflight += 1
        e = self._first_token_engine(route)
        x = prompt_tokens
        predicted = None
        wait = self._slot_wait(route)
        if e is not None:
            x += e.pending_prefill_tokens
            predicted = wait + e.ttft_model.predict(x)
            e.pending_prefill_tokens += prompt_tokens
        self._routes[ticket_id] = _Placement(
            route.engines, e.cfg.name if e else None, prompt_tokens, x, predicted, wait
        )
        return AdmitResult(candidates=tuple(routes))

    def _prefill_done(self, p: "_Placement") -> None:
        if not p.prefill_done:
            p.prefill_done = True
            e = self.engines.get(p.first_engine or "")
            if e is not None:
                e.pending_prefill_tokens = max(0, e.pending_prefill_tokens - p.prompt_tokens)

    async def admit(self, req: AdmitRequest) -> AdmitResult:
        now = self.clock()
        if req.ticket_id in self._tombstones:
            self._tombstones.pop(req.ticket_id)
            return AdmitResult(error=_CANCELLED)  # the ingress counts the cancellation
        reason = self.router.unavailable_reason({e.cfg.wave for e in self.engines.values()})
        if reason is not None:
            return self._refuse_info(router_unavailable(reason), Outcome.REJECTED)
        routes = self._routes_now(now)
        if not routes:
            return self._refuse_info(backend_unavailable(), Outcome.REJECTED)
        if self.cfg.admission.mode == "predictive":
            routes, refusal = self._rank_predictive(routes, req)
            if refusal is not None:
                return self._refuse(refusal)
        decision = self.admission.offer(req.ticket_id, now, req.request_deadline)
        if isinstance(decision, Refusal):
            return self._refuse(decision)
        if isinstance(decision, Grant):
            return self._placed(req.ticket_id, routes, req.prompt_tokens)
        return await self._wait(decision, req.prompt_tokens)

    async def _wait(self, decision: Enqueued, prompt_tokens: int) -> AdmitResult:
        tid = decision.ticket.id
        self._queued_prompt[tid] = prompt_tokens
        self._queued_tokens += prompt_tokens
        fut: asyncio.Future[AdmitResult] = asyncio.get_running_loop().create_future()
        self._waiters[tid] = fut
        self._arm_expiry()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.cancel(tid)  # our caller was cancelled: give back the slot or the grant
            raise

    def _unqueue(self, tid: str) -> int:
        n = self._queued_prompt.pop(tid, 0)
        self._queued_tokens -= n
        return n

    def _pump(self) -> None:
        granted, expired = self.admission.pump(self.clock())
        for t, refusal in expired:
            self._unqueue(t.id)
            fut = self._waiters.pop(t.id, None)
            if fut is not None and not fut.done():
                fut.set_result(self._refuse(refusal))
        for t in granted:
            prompt_tokens = self._unqueue(t.id)
            fut = self._waiters.pop(t.id, None)
            if fut is None or fut.done():
                self.admission.release(t.id)
                continue
            routes = self._routes_now(self.clock())
            if not routes:
                self.admission.release(t.id)
                fut.set_result(self._refuse_info(backend_unavailable(), Outcome.REJECTED))
            else:
                fut.set_result(self._placed(t.id, routes, prompt_tokens))
        self._arm_expiry()

    def _arm_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        nxt = self.admission.next_expiry()
        if nxt is not None:
            delay = max(0.0, nxt - self.clock())
            self._expiry = asyncio.get_running_loop().call_later(delay + 0.001, self._pump)

    def cancel(self, ticket_id: str) -> None:
        """The client went away before its admission answer reached it: free whatever the ticket
        holds (queue slot or granted permits), or, when its admit call has not arrived yet, leave
        a tombstone so that it is refused on arrival.  The ingress counts the cancellation."""
        fut = self._waiters.pop(ticket_id, None)
        if fut is not None:
            self._unqueue(ticket_id)
            self.admission.release(ticket_id)
            if not fut.done():
                fut.set_result(AdmitResult(error=_CANCELLED))
            self._pump()
        elif ticket_id in self.admission.retained:
            self._release(ticket_id, None)
            self._pump()
        else:
            self._tombstones[ticket_id] = None
            while len(self._tombstones) > _TOMBSTONES:
                self._tombstones.popitem(last=False)

    def report(self, rep: Report) -> None:
        self.counters.merge(rep.counters)
        for tid in rep.decode_started:
            self.admission.enter_decode(tid)
            p = self._routes.get(tid)
            if p is not None:
                self._prefill_done(p)
        for tid, stats in rep.released:
            self._release(tid, stats)
        for w in rep.admission_waits:
            self.histograms["admission_wait"].observe(w)
        self._pump()

    def _release(self, tid: str, stats: RelayStats | None) -> None:
        """Idempotent: permits, in-flight and pending-prefill counts of one ticket."""
        self.admission.release(tid)
        p = self._routes.pop(tid, None)
        if p is None:
            return
        self._prefill_done(p)
        for name in p.engines:
            if name in self.engines:
                self.engines[name].inflight -= 1
        if stats is not None:
            self._observe(stats, p)

    def _observe(self, stats: RelayStats, p: "_Placement") -> None:
        if stats.ttft_s is not None:
            self.histograms["ttft"].observe(stats.ttft_s)
            e = self.engines.get(p.first_engine or "")
            if e is not None and stats.attempts == 1 and stats.engines == p.engines:
                # the prefill model learns the TTFT net of the predicted slot wait
                e.ttft_model.observe(p.x_tokens, max(0.0, stats.ttft_s - p.slot_wait_s))
                d = self.engines.get(stats.engines[-1])
                if d is not None:
                    dur = stats.ttft_s + stats.decode_s
                    d.service_s = dur if d.service_s is None else 0.8 * d.service_s + 0.2 * dur
            if p.predicted_s is not None:
                self.histograms["ttft_prediction_error"].observe(abs(stats.ttft_s - p.predicted_s))
                if e is not None:
                    rel = (stats.ttft_s - p.predicted_s) / max(p.predicted_s, 1e-3)
                    e.drift_score = 0.9 * e.drift_score + 0.1 * rel
        if stats.output_tokens > 1:
            tpot = stats.decode_s / (stats.output_tokens - 1)
            self.histograms["tpot"].observe(tpot)
            e = self.engines.get(stats.engines[-1])
            if e is not None:
                e.tpot_s = tpot if e.tpot_s is None else 0.8 * e.tpot_s + 0.2 * tpot

    def metrics_text(self) -> str:
        return render_metrics(self.snapshot(), self.histograms)

    # -- state, admin, views -----------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        if mode not in ("active", "standby", "fenced", "monitoring_degraded"):
            raise ValueError(f"unknown router mode {mode!r}")
        self.router.mode = mode  # type: ignore[assignment]

    def maintenance(self, waves: list[str], on: bool) -> list[str]:
        if on:
            self.router.maintenance.update(waves)
        else:
            self.router.maintenance.difference_update(waves)
        return sorted(self.router.maintenance)

    def register_engine(self, engine: EngineConfig) -> None:
        if engine.name in self.engines:
            raise ValueError(f"engine {engine.name!r} is already registered")
        self.engines[engine.name] = EngineState(engine)

    def deregister_engine(self, name: str) -> bool:
        return self.engines.pop(name, None) is not None

    def readiness(self) -> tuple[bool, str]:
        reason = self.router.unavailable_reason({e.cfg.wave for e in self.engines.values()})
        if reason is not None:
            return False, reason
        if not self.router.started:
            return False, "starting"
        if not self._eligible(self.clock()):
            return False, "no_eligible_engines"
        return True, "active"

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        maint = frozenset(self.router.maintenance)
        ready, reason = self.readiness()
        return {
            "ready": ready,
            "state": reason,
            "router_mode": self.router.mode,
            "maintenance_waves": sorted(maint),
            "admission_mode": self.cfg.admission.mode,
            "counters": self.counters.seed_view(),
            "counters_by_reason": [
                {"outcome": o, "reason": r, "count": n} for (o, r), n in sorted(self.counters.by_outcome.items())
            ],
            "gauges": self.admission.gauges(),
            "engines": [
                e.view(now, self.cfg.monitoring.stale_after_s, maint) for e in self.engines.values()
            ],
        }
