"""The scheduler's state: engines, router state, admission, leases, tenants, counters and
tickets, and the fleet view every decision is made on (``view``). The scheduler's jobs build on it
in layers, one module each: its tickets (``tickets.py``), the admission queue (``queueing.py``), admin
operations (``admin.py``), and its lifecycle and the ingress replicas' reports (``service.py``)."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from narwhal_serve.admission.controller import AdmissionController
from narwhal_serve.admission.core import EngineFacts, FleetView
from narwhal_serve.admission.counters import Counters
from narwhal_serve.admission.ledger import Ticket
from narwhal_serve.admission.retry import MAX_RESERVATIONS, Reservation
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.ha.state import RouterState
from narwhal_serve.placement.engines import EngineState, borrows_ttft, fleet_ttft
from narwhal_serve.prediction.decode import OutputLengths
from narwhal_serve.scheduler.ha import RouterHA
from narwhal_serve.scheduler.health import Profiler, Prober
from narwhal_serve.scheduler.kvfeeds import KVEventFeeds
from narwhal_serve.scheduler.leases import LeaseLedger
from narwhal_serve.scheduler.managed import ManagedFleet, initial_engines
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult
from narwhal_serve.telemetry import TPOT_BUCKETS, Histogram, Tally
from narwhal_serve.tenants.amounts import Amounts
from narwhal_serve.tenants.book import TenantBook
from narwhal_serve.tenants.fair import FairShare
from narwhal_serve.tenants.promises import Promise
from narwhal_serve.tenants.tally import TenantTally


@dataclass
class SchedulerTicket(Ticket):
    """A ticket's charges (the ledger's), and what the scheduler keeps beside them."""

    deadline: float = 0.0
    lease: str | None = None  # the lease that admitted it, or None (admitted here)
    output_charged: float = 0.0  # output tokens charged to its tenant's budget (admitted here)


class SchedulerState(ABC):
    """Everything the scheduler knows, and the view of it a decision reads."""

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
        self.managed = ManagedFleet(cfg, self.engines)  # Ray-managed engines' slots (docs/operations.md, "Managed engines")
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
        self._tickets: dict[str, SchedulerTicket] = {}  # admitted and not yet released
        self._queued_tokens = 0
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self.reservations: OrderedDict[str, Reservation] = OrderedDict()  # room kept for retries (admission/retry.py)
        self._rotation = 0
        self._granted: dict[str, tuple[tuple[object, ...], EngineFacts]] = {}  # facts last granted, and their inputs
        self._client: httpx.AsyncClient | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self.prober = Prober(cfg, clock, lambda: self._pump())
        self.profiler = Profiler(cfg, clock, lambda: self._pump())  # re-measures engines out for drift
        self._background: set[asyncio.Task[None]] = set()  # immediate scrapes of (re)joined engines
        self._ha: asyncio.Task[None] | None = None
        self.calls = {"admit": 0, "report": 0}  # calls from ingress replicas (/status)

    def client(self) -> httpx.AsyncClient:
        """The one HTTP client for engine scrapes, probes and profiles (made on first use)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.monitoring.scrape_timeout_s)
        return self._client

    @abstractmethod
    def _pump(self) -> None:
        """Give queued requests their chance now (the admission desk's: ``queueing.py``)."""

    # -- the view every decision is made on ---------------------------------------------------
    def view(self, now: float, *, queued_tokens: int | None = None, frozen: bool = False) -> FleetView:
        """``frozen``: for a lease grant (it crosses the Ray hop: prefix sets copied, not live)."""
        maint = frozenset(self.router.maintenance)
        stale = self.cfg.monitoring.stale_after_s
        pl = self.cfg.placement
        predictive = self.cfg.admission.mode == "predictive"
        facts = []
        fleet = fleet_ttft(self.engines.values())  # what an engine not measured yet is projected with
        for e in self.engines.values():
            ok = e.eligible(now, stale, maint) and e.last_ok is not None
            m = fleet.get((e.cfg.role, e.cfg.dialect), e.ttft_model) if borrows_ttft(e) else e.ttft_model
            inputs = (
                (e.last_ok or 0.0) + stale if ok else 0.0, e.inflight, e.load, e.pending_prefill_tokens,
                m.a, m.b, e.slots(), e.service_s, e.external(), e.pending_prefill_requests,
                m.c, e.tpot_model.a, e.tpot_model.b, bool(e.tpot_model.samples), e.decode_tokens,
                e.drift.penalty(pl) if predictive else 0.0, e.ttft_errors.margin, e.prefix_credit, e.cache_block_tokens,
                e.managed.report.node_id if e.managed is not None and e.managed.report is not None else None,
                (e.prefix.frozen(pl.prefix_view_blocks) if frozen else e.prefix.held()) if pl.prefix_aware else frozenset(),
                e.cfg,
            )
            kept = self._granted.get(e.cfg.name) if frozen else None
            if kept is not None and kept[0] == inputs:  # unchanged: the same object (leases get changes only)
                facts.append(kept[1])
                continue
            (eu, inflight, load, ppt, ta, tb, slots, service_s, external, ppr, tc, pa, pb, pk, decode, penalty,
             margin, credit, cbt, node, prefix, cfg) = inputs
            f = EngineFacts(
                cfg=cfg, eligible_until=eu, inflight=inflight, load=load, pending_prefill_tokens=ppt, ttft_a=ta,
                ttft_b=tb, slots=slots, service_s=service_s, external=external, pending_prefill_requests=ppr,
                ttft_c=tc, tpot_a=pa, tpot_b=pb, tpot_known=pk, decode_tokens=decode, penalty=penalty,
                ttft_margin=margin, prefix_credit=credit, cache_block_tokens=cbt, node=node, prefix=prefix,
            )
            if frozen:
                self._granted[e.cfg.name] = (inputs, f)
            facts.append(f)
        if frozen and len(self._granted) > len(self.engines):  # engines removed by a reload
            self._granted = {k: v for k, v in self._granted.items() if k in self.engines}
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
        """Why the router refuses everything now (docs/contract.md, "Routes": the /ready reasons), or None: its lease
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
