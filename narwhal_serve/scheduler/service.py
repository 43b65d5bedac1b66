"""The scheduler: single source of truth for engines, router state, admission and counters.

Plain asyncio, no Ray: the Ray deployment (``deployments/scheduler.py``) only forwards calls here,
and tests drive it directly.  Admission decisions are :func:`narwhal_serve.admission.core.decide`,
the same pure function ingress replicas run under their leases (:mod:`.leases`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx

from narwhal_serve.admission import ledger
from narwhal_serve.admission.controller import AdmissionController, Enqueued, Grant, Refusal
from narwhal_serve.admission.core import EngineFacts, FleetView, Placement, decide, rank
from narwhal_serve.admission.counters import Counters
from narwhal_serve.admission.ledger import Ticket
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.admission.retry import MAX_RESERVATIONS, Reservation, earliest
from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.errors import ErrorInfo, NarwhalError
from narwhal_serve.errors import backend_unavailable, router_unavailable
from narwhal_serve.ha.state import RouterState
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.prefix import index_capacity
from narwhal_serve.protocol.estimate import CHARS_PER_TOKEN
from narwhal_serve.prediction.decode import OutputLengths
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.ha import RouterHA
from narwhal_serve.managed.slot import ReplicaReport
from narwhal_serve.scheduler.health import Profiler, Prober, apply_health, update_drift
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.scheduler.leases import LEASE_TTL_S, LeaseLedger
from narwhal_serve.scheduler.managed import ManagedFleet, initial_engines
from narwhal_serve.admission.wire import LeaseGrant, LocalPlacement
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report
from narwhal_serve.scheduler.monitor import scrape_all, scrape_one
from narwhal_serve.scheduler.kvfeeds import KVEventFeeds
from narwhal_serve.scheduler.snapshot import snapshot
from narwhal_serve.telemetry import TPOT_BUCKETS, Histogram, Tally, render_metrics
from narwhal_serve.tenants.amounts import Amounts, request_cost
from narwhal_serve.tenants.book import TenantBook
from narwhal_serve.tenants.promises import Promise
from narwhal_serve.tenants.rules import budget_error
from narwhal_serve.tenants.fair import FairShare
from narwhal_serve.tenants.tally import TenantTally

REAP_GRACE_S = 5.0  # a ticket past its request deadline by this much is forgotten (permits freed)


@dataclass
class _Ticket(Ticket):
    """A ticket's charges (the ledger's), and what the scheduler keeps beside them."""

    deadline: float = 0.0
    lease: str | None = None  # the lease that admitted it, or None (admitted here)
    output_charged: float = 0.0  # output tokens charged to its tenant's budget (admitted here)


_CANCELLED = NarwhalError("the client went away while waiting for admission", code="cancelled").info()
_TOMBSTONES = 4096


class SchedulerService:
    def __init__(
        self, cfg: NarwhalConfig, *, clock: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.ha = RouterHA(cfg, mono=mono)  # the router's lease and its monitoring's health
        self.admission = AdmissionController(cfg.admission, cfg.serving)
        self.leases = LeaseLedger(self.admission)
        self.engines: dict[str, EngineState] = initial_engines(cfg)
        for e in self.engines.values():
            e.prefix.capacity = cfg.placement.prefix_index_blocks
            e.ttft_errors.quantile = cfg.admission.ttft_confidence
        self.kv_events = KVEventFeeds(cfg.placement)  # engines whose KV events feed their prefix index
        self.outputs = OutputLengths()  # identified output lengths per route kind and max_tokens bucket
        self.managed = ManagedFleet(cfg, self.engines)  # Ray-managed engines' slots (README, "Managed engines")
        # ha.role is the mode of a lone router; with a lease backend the lease decides (role: a hint)
        lone_standby = cfg.ha.role == "standby" and cfg.ha.lease.backend == "none"
        self.router = RouterState(mode="standby" if lone_standby else "active")
        self.counters = Counters()
        specs = cfg.tenants.by_name() if cfg.tenants is not None else {}
        self.tenants = TenantBook(specs)  # tenants' budgets (tenants/)
        self.fair = FairShare({name: t.weight for name, t in specs.items()})
        self.tenant_tally = TenantTally(tuple(specs), tuple(c.name for c in cfg.admission.classes))
        # tickets that took budget here, not placed yet: tenant, cost, the promise they used
        self._budgeted: dict[str, tuple[str, Amounts, Promise | None]] = {}
        self.histograms = {
            "ttft": Histogram(),
            "tpot": Histogram(TPOT_BUCKETS),
            "admission_wait": Histogram(),
            "ttft_prediction_error": Histogram(),
            "ttft_predicted": Histogram(),
            "resume_gap": Histogram(),
            "resume_prefill": Histogram(),
            "resume_turnaround": Histogram(),
        }
        self.tally = Tally()  # admitted, goodput, predicted vs measured TTFT per engine (/metrics)
        self._waiters: dict[str, asyncio.Future[AdmitResult]] = {}
        self._waiting: dict[str, AdmitRequest] = {}  # queued tickets' requests
        self._tickets: dict[str, _Ticket] = {}  # admitted and not yet released
        self._queued_tokens = 0
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self.reservations: OrderedDict[str, Reservation] = OrderedDict()  # room kept for retries (admission/retry.py)
        self._rotation = 0
        self._client: httpx.AsyncClient | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self.prober = Prober(cfg, clock, lambda: self._pump())
        self.profiler = Profiler(cfg, clock, lambda: self._pump())  # re-measures engines out for drift
        self._background: set[asyncio.Task[None]] = set()  # immediate scrapes of (re)joined engines
        self._ha: asyncio.Task[None] | None = None
        self.calls = {"admit": 0, "report": 0}  # calls from ingress replicas (/status)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.kv_events.start(self.engines.values())
        if self._monitor is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.monitoring.scrape_timeout_s)
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop())
        if self._ha is None and self.ha.lease is not None:
            self._ha = asyncio.get_running_loop().create_task(self.ha.run(self._pump))

    async def stop(self) -> None:
        await self.kv_events.stop()
        self.prober.cancel()
        self.profiler.cancel()
        for t in list(self._background):
            t.cancel()
        if self._ha is not None:
            self._ha.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ha  # hands the lease over (release) on the way out
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self._client is not None:
            await self._client.aclose()

    async def _monitor_loop(self) -> None:
        while True:
            await self.scrape_once()
            self.reap()
            self.start_probes()
            await asyncio.sleep(self.cfg.monitoring.scrape_interval_s)

    def start_probes(self) -> None:
        """A probe for each engine whose breaker has been open its full period."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.monitoring.scrape_timeout_s)
        self.prober.start_due(self.engines.values(), self._client)
        if self.cfg.admission.mode == "predictive":  # open mode judges nothing by the engines' models
            update_drift(self.engines, self.clock(), self.cfg)
            self.profiler.start_due(self.engines.values(), self._client)

    async def scrape_once(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.monitoring.scrape_timeout_s)
        await scrape_all(
            self._client, list(self.engines.values()), self.clock(), self.cfg.monitoring.scrape_timeout_s
        )
        pl = self.cfg.placement
        for e in self.engines.values():  # an index never remembers more than the engine's KV cache holds
            if e.prefix_exact:
                e.prefix.resize(max(pl.prefix_index_blocks, e.load.kv_tokens // pl.prefix_block_tokens))
                continue
            e.prefix.resize(index_capacity(pl.prefix_index_blocks, e.load.kv_tokens,
                                           pl.prefix_block_chars / CHARS_PER_TOKEN))
        self.router.started = True
        self.ha.last_pass = self.clock()
        self._pump()  # engines may have become eligible for queued requests

    def reap(self) -> None:
        """Bound every ticket's life: forget tickets long past their deadline, and leases (with
        their tickets) whose ingress went silent."""
        now = self.clock()
        for lease_id, rec in self.leases.orphans(now):
            self.tenants.forget_lease(lease_id)
            for tid in list(rec.tickets):
                self._release(tid, None)
        for tid in [t for t, k in self._tickets.items() if now > k.deadline + REAP_GRACE_S]:
            self._release(tid, None)
        self._pump()

    # -- the view every decision is made on ---------------------------------------------------
    def view(self, now: float, *, queued_tokens: int | None = None, frozen: bool = False) -> FleetView:
        """``frozen``: for a lease grant (it crosses the Ray hop: prefix sets copied, not live)."""
        maint = frozenset(self.router.maintenance)
        stale = self.cfg.monitoring.stale_after_s
        pl = self.cfg.placement
        predictive = self.cfg.admission.mode == "predictive"
        facts = []
        for e in self.engines.values():
            ok = e.eligible(now, stale, maint) and e.last_ok is not None
            facts.append(EngineFacts(
                cfg=e.cfg, eligible_until=(e.last_ok or 0.0) + stale if ok else 0.0, inflight=e.inflight,
                load=e.load, pending_prefill_tokens=e.pending_prefill_tokens, ttft_a=e.ttft_model.a,
                ttft_b=e.ttft_model.b, slots=e.slots(), service_s=e.service_s, external=e.external(),
                pending_prefill_requests=e.pending_prefill_requests, ttft_c=e.ttft_model.c,
                tpot_a=e.tpot_model.a, tpot_b=e.tpot_model.b, tpot_known=bool(e.tpot_model.samples),
                decode_tokens=e.decode_tokens, penalty=e.drift.penalty(pl) if predictive else 0.0,
                ttft_margin=e.ttft_errors.margin,
                prefix_credit=e.prefix_credit, cache_block_tokens=e.cache_block_tokens,
                prefix=(e.prefix.frozen(pl.prefix_view_blocks) if frozen else e.prefix.held()) if pl.prefix_aware else frozenset(),
            ))
        return FleetView(
            engines=tuple(facts),
            unavailable=self.unavailable(now),
            epoch=self.ha.epoch(),
            predictive=predictive,
            queued_tokens=self._queued_tokens if queued_tokens is None else queued_tokens,
            queued=len(self.admission.queue) if queued_tokens is None else 0,
            outputs=self.outputs.table(),
            reservations=self._live_reservations(now),
            streams_end_at=self.router.drain_until,
            over_share=self.fair.over(now),
        )

    def _live_reservations(self, now: float) -> tuple[Reservation, ...]:
        for rid in [k for k, r in self.reservations.items() if not r.live(now)]:
            del self.reservations[rid]
        return tuple(self.reservations.values())

    def _reserve(self, r: Reservation) -> None:
        self.reservations[r.id] = r
        while len(self.reservations) > MAX_RESERVATIONS:
            self.reservations.popitem(last=False)

    def unavailable(self, now: float) -> str | None:
        """Why the router refuses everything now (README, "Routes": the /ready reasons), or None: its lease
        (standby, fenced), its admin mode, whole-wave maintenance, then its own monitoring."""
        lease_mode = self.ha.lease_mode()
        if lease_mode is not None and lease_mode != "active":
            return lease_mode
        reason = self.router.unavailable_reason({e.cfg.wave for e in self.engines.values()})
        if reason is not None:
            return reason
        if self.router.started and self.ha.degraded(self.engines.values(), now, frozenset(self.router.maintenance)):
            return "monitoring_degraded"
        return None

    # -- admission ---------------------------------------------------------------------------
    def _refuse(self, refusal: Refusal, req: AdmitRequest | None = None) -> AdmitResult:
        return self._refuse_info(refusal.error, refusal.outcome, req)

    def _refuse_info(self, err: ErrorInfo, outcome: Outcome, req: AdmitRequest | None = None) -> AdmitResult:
        """A refusal by the scheduler, counted here (with its tenant and class when known)."""
        tally = self.tenant_tally
        self.counters.add(outcome, err.code, tenant=tally.label(req.tenant) if req is not None else None,
                          klass=tally.class_label(req.rank) if req is not None else None)
        return AdmitResult(error=err, outcome=outcome)

    def _refund(self, tid: str) -> None:
        """The ticket took budget here and never ran: its tenant gets it back."""
        got = self._budgeted.pop(tid, None)
        if got is not None:
            self.tenants.refund(got[0], got[1], self.clock(), got[2])

    def _charge(self, tid: str, placement: Placement, deadline: float, lease: str | None) -> None:
        self.tally.admitted += 1
        self.fair.admitted(placement.tenant, placement.prefill_tokens, self.clock())
        if placement.cached_tokens:
            self.tally.prefix_hits += 1
            self.tally.prefix_cached_tokens += placement.cached_tokens
        t = self._tickets[tid] = _Ticket(placement, placement.engines, deadline=deadline, lease=lease)
        self._apply(ledger.admitted(t))

    def _apply(self, deltas: ledger.Deltas) -> None:
        """The ledger's changes applied to the engines' live counts (an engine gone: skipped)."""
        for name, d in deltas.items():
            e = self.engines.get(name)
            if e is None:
                continue
            e.inflight += d.inflight
            e.pending_prefill_tokens = max(0, e.pending_prefill_tokens + d.pending_prefill_tokens)
            e.pending_prefill_requests = max(0, e.pending_prefill_requests + d.pending_prefill_requests)
            e.decode_tokens = max(0.0, e.decode_tokens + d.decode_tokens)
            if d.prefix:
                e.prefix.pend(d.prefix)  # a pending prefix (admission/core.py charge)
            if d.prefix_done:
                e.prefix.unpend(d.prefix_done)

    def _progress(self, tid: str, tokens: int) -> None:
        """Decode correction: the ticket's remaining decode from the tokens it generated so far."""
        t = self._tickets.get(tid)
        if t is not None:
            self._apply(ledger.progressed(t, tokens))
            if t.lease is None and tokens > t.output_charged:  # (a lease charges its own tickets' outputs)
                self.tenants.charge_output(t.placement.tenant, tokens - t.output_charged, self.clock())
                t.output_charged = tokens

    def _placed(self, tid: str, placement: Placement, deadline: float) -> AdmitResult:
        self._budgeted.pop(tid, None)  # its ticket holds the budget now (released with it)
        self._charge(tid, placement, deadline, None)
        st = self.tenants.states.get(placement.tenant)
        return AdmitResult(candidates=placement.routes, predicted_ttft_s=placement.predicted_s, epoch=self.ha.epoch(),
                           remaining=st.remaining() if st is not None else None)

    async def admit(self, req: AdmitRequest) -> AdmitResult:
        self.calls["admit"] += 1
        now = self.clock()
        self.leases.returned(req.lease_id, req.returned, req.lease_epoch)
        if req.tenant_returned.any():
            rec = self.leases.leases.get(req.lease_id or "")
            self.tenants.given_back(req.lease_id, req.tenant, req.tenant_returned,
                                    rec is not None and rec.epoch == req.lease_epoch, now, req.ticket_id)
        if req.ticket_id in self._tombstones:
            self._tombstones.pop(req.ticket_id)
            self._pump()
            return AdmitResult(error=_CANCELLED)  # the ingress counts the cancellation
        if self.tenants.specs:
            cost = request_cost(req.prompt_tokens)
            over = self.tenants.check(req.tenant, cost, now, fingerprint=req.fingerprint, reserves=req.reserves)
            if over is not None:
                self._pump()
                return self._refuse(Refusal(budget_error(over), Outcome.REJECTED), req)
            self._budgeted[req.ticket_id] = (req.tenant, cost, self.tenants.last_taken)
        self._rotation += 1
        view = self.view(now)
        verdict = decide(view, req.ask(), now, self._rotation)
        if isinstance(verdict, Refusal):
            self._refund(req.ticket_id)
            if verdict.reserve is not None:
                self._reserve(replace(verdict.reserve, id=req.ticket_id))
            self._pump()
            return self._refuse(verdict, req)
        decision = self.admission.offer(req.ticket_id, now, req.request_deadline, req.rank, req.tenant)
        if isinstance(decision, Refusal):
            self._refund(req.ticket_id)
            self._pump()
            return self._refuse(decision, req)
        if req.retry and (r := earliest(view.reservations, now)) is not None:
            self.reservations.pop(r.id, None)  # the retry takes the room kept for it
        if isinstance(decision, Grant):
            return self._placed(req.ticket_id, verdict, req.request_deadline)
        return await self._wait(decision, req)

    async def _wait(self, decision: Enqueued, req: AdmitRequest) -> AdmitResult:
        tid = decision.ticket.id
        self._waiting[tid] = req
        self._queued_tokens += req.prompt_tokens
        fut: asyncio.Future[AdmitResult] = asyncio.get_running_loop().create_future()
        self._waiters[tid] = fut
        self._pump()  # returned lease permits may grant it at once
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.cancel(tid)  # our caller was cancelled: give back the slot or the grant
            raise

    def _unqueue(self, tid: str) -> AdmitRequest | None:
        req = self._waiting.pop(tid, None)
        if req is not None:
            self._queued_tokens -= req.prompt_tokens
        return req

    def _pump(self) -> None:
        now = self.clock()
        granted, expired = self.admission.pump(now, self.fair.over(now))
        for t, refusal in expired:
            req = self._unqueue(t.id)
            self._refund(t.id)
            fut = self._waiters.pop(t.id, None)
            if fut is not None and not fut.done():
                fut.set_result(self._refuse(refusal, req))
        for t in granted:
            req = self._unqueue(t.id)
            fut = self._waiters.pop(t.id, None)
            if req is None or fut is None or fut.done():
                self._refund(t.id)
                self.admission.release(t.id)
                continue
            if (reason := self.unavailable(now)) is not None:  # fenced, standby...: nothing is admitted
                self._refund(t.id)
                self.admission.release(t.id)
                fut.set_result(self._refuse_info(router_unavailable(reason), Outcome.REJECTED, req))
                continue
            # ranked again now (it waited); nothing queued is ahead of it any more
            self._rotation += 1
            placement, _ = rank(self.view(now, queued_tokens=0), req.ask(), now, self._rotation)
            if placement is None:
                self._refund(t.id)
                self.admission.release(t.id)
                fut.set_result(self._refuse_info(backend_unavailable(), Outcome.REJECTED, req))
            else:
                fut.set_result(self._placed(t.id, placement, req.request_deadline))
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
            self._refund(ticket_id)
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

    def report(self, rep: Report) -> LeaseGrant | None:
        self.calls["report"] += 1
        now = self.clock()
        self.counters.merge(rep.counters)
        grant_for = None
        if rep.lease is not None:
            part = rep.lease
            rec, fresh = self.leases.touch(part.lease_id, part.in_use, now)
            self.leases.returned(part.lease_id, part.returned, part.epoch)
            if part.tenants is not None:
                self.tenants.lease_report(part.lease_id, part.tenants, now, fresh=fresh or part.epoch != rec.epoch)
            for lp in part.placed:
                self._local_placed(lp, part.lease_id)
            for r in part.reserved:
                self._reserve(r)
            for rid in part.consumed:
                self.reservations.pop(rid, None)
            grant_for = (rec, fresh)
        apply_health(self.engines, rep.health, now, self.cfg)
        for tid, engines in rep.decode_started:
            self.admission.enter_decode(tid)
            t = self._tickets.get(tid)
            if t is not None:
                if not t.prefill_done and engines == t.placement.engines and self.cfg.placement.prefix_aware \
                        and (e := self.engines.get(t.placement.first_engine or "")) is not None \
                        and not e.prefix_exact:  # (an engine's own KV events say what it holds)
                    e.prefix.insert(t.placement.prefix)  # its prefill is done: the engine holds its blocks now
                self._apply(ledger.first_token(t, engines))
        for tid, tokens in rep.progress.items():
            self._progress(tid, tokens)
        for tid, stats, completed in rep.released:
            self._release(tid, stats, completed)
        for w in rep.admission_waits:
            self.histograms["admission_wait"].observe(w)
        self._pump()
        if grant_for is None or rep.lease is None:
            return None
        rec, _ = grant_for
        granted, target = self.leases.grant(rec, bool(self.admission.queue))
        shares, targets = self.tenants.grant(rep.lease.lease_id, now, len(self.leases.leases))
        return LeaseGrant(rep.lease.lease_id, rep.lease.generation, self.view(now, frozen=True), now,
                          self.ha.ingress_ttl(LEASE_TTL_S), granted, target, epoch=rec.epoch,
                          tenant_granted=shares, tenant_targets=targets, tenant_facts=self.tenants.facts(now))

    def _local_placed(self, lp: LocalPlacement, lease_id: str) -> None:
        self._charge(lp.ticket_id, lp.placement, lp.deadline, lease_id)
        rec = self.leases.leases.get(lease_id)
        if rec is not None:
            rec.tickets.add(lp.ticket_id)

    def _release(self, tid: str, stats: RelayStats | None, completed: bool = False) -> None:
        """Idempotent: permits, in-flight and pending-prefill counts of one ticket."""
        self.admission.release(tid)
        t = self._tickets.pop(tid, None)
        if t is None:
            return
        if t.lease is not None and (rec := self.leases.leases.get(t.lease)) is not None:
            rec.tickets.discard(tid)
        self._apply(ledger.released(t))
        if stats is not None:
            learn_from(stats, t.placement, self.engines, self.histograms, self.tally, completed, self.outputs,
                       self.clock(), self.cfg.placement)
        self.tenant_tally.ended(t.placement.tenant, t.placement, stats, completed)
        if self.tenants.specs:
            p = t.placement
            out = stats.output_tokens if stats is not None else t.output_charged
            duration = stats.ttft_s + stats.decode_s if stats is not None and stats.ttft_s is not None else None
            self.tenants.ended(p.tenant, self.clock(), output_tokens=max(0.0, out - t.output_charged) if t.lease is None else 0.0,
                               duration_s=duration, own=t.lease is None)

    def metrics_text(self) -> str:
        return render_metrics(self.snapshot(), self.histograms)

    # -- state, admin, views -----------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        if mode not in ("active", "standby", "fenced", "monitoring_degraded"):
            raise ValueError(f"unknown router mode {mode!r}")
        if self.ha.lease is not None:
            raise ValueError("with ha.lease.backend: redis the lease decides the router's mode")
        self.router.mode = mode  # type: ignore[assignment]

    def drain(self, grace_s: float, now: float) -> float:
        """Stop admitting (503 ``router_unavailable``, reason ``draining``; ``/ready`` 503) and let
        the requests in flight finish; ``grace_s`` from now the ingress replicas end the streams
        still open with an error event.  Under a router lease, the lease is given up at once so
        that the standby takes over now, not after its TTL.  Returns the end of the grace period;
        a second call can only shorten it."""
        until = now + max(0.0, grace_s)
        self.router.drain_until = until if self.router.drain_until is None else min(until, self.router.drain_until)
        self.ha.give_up()
        return self.router.drain_until

    def maintenance(self, waves: list[str], on: bool) -> list[str]:
        """Engines of these waves take no new work; in-flight requests finish (``draining``)."""
        unknown = sorted(set(waves) - {e.cfg.wave for e in self.engines.values()})
        if on and unknown:
            raise ValueError(f"unknown wave(s) {unknown}; engines are in {sorted({e.cfg.wave for e in self.engines.values()})}")
        if on:
            self.router.maintenance.update(waves)
        else:
            self.router.maintenance.difference_update(waves)
        return sorted(self.router.maintenance)

    def register_managed(self, rep: ReplicaReport) -> str:
        """A managed engine's replica reports its engine up (first, after a restart, or as its
        heartbeat); a changed engine is scraped at once, so it rejoins without waiting a pass."""
        name, changed = self.managed.register(rep, self.clock())
        if changed:
            self._scrape_soon(name)
            e = self.engines.get(name)
            if e is not None and self._monitor is not None:
                self.kv_events.restart(e)  # a new process: new sockets, a new cache
        return name

    def managed_down(self, engine: str, replica: str, reason: str) -> None:
        self.managed.down(engine, replica, reason, self.clock())

    def _scrape_soon(self, name: str) -> None:
        async def scrape() -> None:
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=self.cfg.monitoring.scrape_timeout_s)
            if (e := self.engines.get(name)) is not None:
                await scrape_one(self._client, e, self.clock(), self.cfg.monitoring.scrape_timeout_s)
                self._pump()

        task = asyncio.get_running_loop().create_task(scrape())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def register_engine(self, engine: EngineConfig) -> None:
        if engine.launch is not None:
            raise ValueError("engines with a launch spec are started from the serve config; register a URL")
        if engine.name in self.engines:
            raise ValueError(f"engine {engine.name!r} is already registered")
        self.engines[engine.name] = e = EngineState(engine)
        e.prefix.capacity = self.cfg.placement.prefix_index_blocks
        e.ttft_errors.quantile = self.cfg.admission.ttft_confidence
        if self._monitor is not None:
            self.kv_events.start([e])

    def deregister_engine(self, name: str) -> bool:
        self.kv_events.drop(name)
        return self.engines.pop(name, None) is not None

    def readiness(self) -> tuple[bool, str]:
        reason = self.unavailable(self.clock())
        if reason is not None:
            return False, reason
        if not self.router.started:
            return False, "starting"
        now = self.clock()
        if not any(e.eligible(now) for e in self.view(now).engines):
            return False, "no_eligible_engines"
        return True, "active"

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self)
