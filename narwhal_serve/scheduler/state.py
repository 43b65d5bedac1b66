"""The scheduler's state: engines, router state, admission, leases, tenants, counters and
tickets, and the fleet view every decision is made on (``view``). The scheduler's jobs build on it
in layers, one module each: its tickets (``tickets.py``), the admission queue (``queueing.py``), admin
operations (``admin.py``), and its lifecycle and the ingress replicas' reports (``service.py``)."""

from __future__ import annotations

import asyncio
import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx

from narwhal_serve.admission.controller import AdmissionController
from narwhal_serve.admission.core import EngineFacts, FleetView
from narwhal_serve.admission.counters import Counters
from narwhal_serve.admission.ledger import Ticket, releases
from narwhal_serve.admission.retry import MAX_RESERVATIONS, Reservation
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.ha.state import RouterState
from narwhal_serve.placement.engines import (EngineState, FleetPrior, PriorCoeffs, borrows_ttft, fleet_ttft,
                                             settled_prior)
from narwhal_serve.prediction.ttft import PrefillModel
from narwhal_serve.prediction.decode import OutputLengths, mean_remaining, tpot_at
from narwhal_serve.scheduler.ha import RouterHA
from narwhal_serve.scheduler.health import Profiler, Prober
from narwhal_serve.kvevents.shard import ShardLink
from narwhal_serve.scheduler.kvfeeds import KVEventFeeds, ShardedKVFeeds
from narwhal_serve.scheduler.granted import GrantedFacts, kept_eligible, same_but_releases
from narwhal_serve.scheduler.granted import facts as granted_facts
from narwhal_serve.scheduler.leases import GrantView, Held, LeaseLedger
from narwhal_serve.scheduler.managed import ManagedFleet, initial_engines
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult
from narwhal_serve.scheduler.watch import PlacementWatch
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

    check_views = False  # tests: every incremental grant view checked against every engine read anew

    def __init__(
        self, cfg: NarwhalConfig, *, clock: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic,
        kv_shards: Sequence[ShardLink] = (),
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.ha = RouterHA(cfg, mono=mono)  # the router's lease and its monitoring's health
        self.admission = AdmissionController(cfg.admission, cfg.serving)
        self.leases = LeaseLedger(self.admission)
        self.engines: dict[str, EngineState] = initial_engines(cfg)
        for e in self.engines.values():
            e.configure(cfg)
        # engines whose KV events feed their prefix index: here, or in the shards given
        self.kv_events: KVEventFeeds | ShardedKVFeeds = (
            ShardedKVFeeds(cfg.placement, kv_shards, mono, self.touch) if kv_shards
            else KVEventFeeds(cfg.placement, self.touch))
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
        # the same tickets by the engine their decode is charged to, in the order they came there
        # (the slot releases an engine's facts carry: admission/ledger.py releases)
        self._decoding: dict[str, dict[str, SchedulerTicket]] = {}
        self._queued_tokens = 0
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self.reservations: OrderedDict[str, Reservation] = OrderedDict()  # room kept for retries (admission/retry.py)
        self._rotation = 0
        self.granted = GrantedFacts()  # the engines' facts granted to leases (granted.py)
        # the monitoring's verdict "not degraded" while sure to hold: what it was judged on, until when
        self._fleet_kept: tuple[tuple[object, ...], float] | None = None
        self._maintenance: frozenset[str] = frozenset()
        # engines whose breaker opened and is not closed again: when it opened (views carry it, and an
        # ingress resumes the streams still on such an engine elsewhere)
        self.tripped: dict[str, float] = {}
        # the fleet's TTFT prior as of the last read of every engine (what the granted facts of an
        # engine not measured yet carry until the next, and kept then while it moved within its
        # tolerance, placement/engines.py settled_prior: a prior refitted with every measurement
        # would otherwise change every such engine's facts, at a thousand engines most of them, each time)
        self._fleet_prior: Mapping[tuple[str, str], PriorCoeffs] = {}
        self._waves: set[str] = set()
        self._unavailable_fleet: str | None = None
        self._client: httpx.AsyncClient | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self.prober = Prober(cfg, clock, self._health_changed)
        self.profiler = Profiler(cfg, clock, self._health_changed)  # re-measures engines out for drift
        self._background: set[asyncio.Task[None]] = set()  # immediate scrapes of (re)joined engines
        self._ha: asyncio.Task[None] | None = None
        self.calls = {"admit": 0, "admit_failed": 0, "report": 0, "report_failed": 0, "watch": 0}  # from ingress replicas (/status)
        self.placement_watch = PlacementWatch()  # leases' parked watch calls (watch.py)

    def client(self) -> httpx.AsyncClient:
        """The one HTTP client for engine scrapes, probes and profiles (made on first use)."""
        if self._client is None:
            # (the engines themselves, never through a proxy the environment names)
            self._client = httpx.AsyncClient(timeout=self.cfg.monitoring.scrape_timeout_s, trust_env=False)
        return self._client

    def _health_changed(self) -> None:
        """A probe closed a breaker, or profiling brought an engine back: queued requests may fit."""
        self.views_stale()
        self._pump()

    @abstractmethod
    def _pump(self) -> None:
        """Give queued requests their chance now (the admission desk's: ``queueing.py``)."""

    # -- the view every decision is made on ---------------------------------------------------
    def touch(self, name: str) -> None:
        """Engine ``name``'s state changed: its facts are read again for the next grant."""
        self.granted.touched.add(name)

    def views_stale(self) -> None:
        """Something not tied to one engine changed (the fleet, a mode, a scrape pass): every
        engine's facts are read again for the next grant, and the monitoring's state."""
        self.granted.full_at = -math.inf
        self._fleet_kept = None

    def _inputs(self, e: EngineState, now: float, fleet: FleetPrior, frozen: bool) -> tuple[object, ...]:
        """What an engine's facts are made of (read from its live state)."""
        stale = self.cfg.monitoring.stale_after_s
        pl = self.cfg.placement
        predictive = self.cfg.admission.mode == "predictive"
        ok = e.eligible(now, stale, self._maintenance) and e.last_ok is not None
        m = fleet.get((e.cfg.role, e.cfg.dialect), e.ttft_model) if borrows_ttft(e) else e.ttft_model
        return (
            (e.last_ok or 0.0) + stale if ok else 0.0, e.inflight, e.load, e.pending_prefill_tokens,
            m.a, m.b, e.slots(), e.service_s, e.external(), e.pending_prefill_requests,
            m.c, e.tpot_model.a, e.tpot_model.b, bool(e.tpot_model.samples), e.decode_tokens,
            e.drift.penalty(pl) if predictive else 0.0, e.ttft_errors.margin, e.idle_margin(),
            e.prefix_credit, e.cache_block_tokens,
            e.managed.report.node_id if e.managed is not None and e.managed.report is not None else None,
            self._releases(e, m, now) if predictive else (),
            e.line_since, next(iter(e.prefill_line.values()), 0), e.context,
            (e.prefix.frozen(pl.prefix_view_blocks) if frozen else e.prefix.held()) if pl.prefix_aware else frozenset(),
            e.cfg,
        )

    def _releases(self, e: EngineState, m: PrefillModel | PriorCoeffs, now: float) -> tuple[float, ...]:
        """When each of the next requests beyond its slots can start its prefill at ``e``, from the
        tickets decoding there and its prefill model ``m`` (admission/ledger.py releases); none
        before a TPOT measurement or with a free slot."""
        slots = e.slots()
        if not slots or not e.tpot_model.samples or e.in_flight() + 1 <= slots:
            return ()
        tpot = tpot_at(e.tpot_model.a, e.tpot_model.b, slots)
        # (none of the router's own there: other clients' requests, of the mean length learned)
        per_request = mean_remaining(e.decode_tokens, e.inflight, self.outputs.mean())
        return releases(self._decoding.get(e.cfg.name, {}).values(), slots, e.external(), m.a, tpot,
                        m.a + per_request * tpot, m.b, m.c, now=now)

    def _refresh_granted(self, now: float) -> None:
        """The facts granted to leases brought up to date: every engine's when due (FULL_VIEW_S
        since the last time, a scrape pass, an admin change, the fleet changed), else only the
        touched engines'."""
        g = self.granted
        touched = g.take_touched(self.engines.keys())
        if g.full_due(now, len(self.engines)) \
                or any((e := self.engines[n]).ttft_model.samples and (e.cfg.role, e.cfg.dialect) not in self._fleet_prior
                       for n in touched):  # (the first measurement of a kind: a prior at once, not the generic one)
            self._read_all(now)
            return
        for name in touched:
            g.put(name, self._inputs(self.engines[name], now, self._fleet_prior, True), now)
        if self.check_views:  # tests: the touched engines were all that changed (an eligibility time
            # kept at the last full read may be kept until the next one; slot releases are not compared)
            for name, e in self.engines.items():
                kept = g.by_name[name][0]
                fresh = kept_eligible(self._inputs(e, now, self._fleet_prior, True), kept, g.full_at)
                assert same_but_releases(kept, fresh), f"{name} changed untouched"

    def _read_all(self, now: float) -> None:
        """Every engine's facts read, and what is read from the whole fleet with them (the TTFT
        prior, maintenance, the monitoring's state, membership)."""
        g = self.granted
        g.full_at = now
        self._maintenance = frozenset(self.router.maintenance)
        self._fleet_prior = {k: settled_prior(self._fleet_prior.get(k), m) for k, m in fleet_ttft(self.engines.values()).items()}
        self._unavailable_fleet = self._fleet_reason(now)
        g.members_now(self.engines)
        for name, e in self.engines.items():
            g.put(name, self._inputs(e, now, self._fleet_prior, True), now)

    def view(self, now: float, *, queued_tokens: int | None = None, frozen: bool = False) -> FleetView:
        """``frozen``: for a lease grant (it crosses the Ray hop: prefix sets copied, not live),
        read O(changed) (:meth:`_refresh_granted`).  Otherwise every engine read now (tests; the
        scheduler's decisions and ``/ready`` use :meth:`decision_view`)."""
        if frozen:
            facts = self._granted_facts(now)
            return self._fleet_view(now, facts, queued_tokens, self._granted_unavailable())
        self._maintenance = frozenset(self.router.maintenance)
        fleet = fleet_ttft(self.engines.values())
        facts = [granted_facts(self._inputs(e, now, fleet, False)) for e in self.engines.values()]
        return self._fleet_view(now, facts, queued_tokens, self.unavailable(now))

    def decision_view(self, now: float, *, queued_tokens: int | None = None) -> FleetView:
        """The view the scheduler's own decisions (its queue, and every request without admission
        leases) are made on: the facts granted to leases brought up to date, O(changed) — the same
        facts a lease decides on, not every engine read again per decision — and the router's state
        as a grant carries it (:meth:`_granted_unavailable`).  Each is the one before with the engines
        changed since (FleetView.merged), so what decisions derive from a view (its route order,
        its block index) is kept and updated, not made again per decision."""
        self._refresh_granted(now)
        fresh = self._fleet_view(now, (), queued_tokens, self._granted_unavailable())
        return self.granted.decision_view(fresh, self.engines)

    def _granted_facts(self, now: float) -> list[EngineFacts]:
        self._refresh_granted(now)
        return self.granted.all(self.engines)

    def grant_view(self, now: float, since: int | None, held: dict[str, Held]) -> GrantView:
        """A lease's view: whole (``since`` None), or the engines changed after change number
        ``since`` as rows (EngineFacts.row) with their configs where the lease does not hold
        those, and the changes of the prefix sets that are not the ones it holds (``held``, by
        engine: updated to what it will hold; facts.prefix_change)."""
        self._refresh_granted(now)
        unavailable = self._granted_unavailable()
        if since is None:
            view = self.view(now, frozen=True)
            held.clear()
            held.update((f.cfg.name, (f.cfg, f.prefix)) for f in view.engines)
            return view, None, ()
        prefixes, rows = self.granted.delta(since, held)
        return self._fleet_view(now, (), None, unavailable), prefixes, tuple(rows)

    def _fleet_view(self, now: float, facts: Sequence[EngineFacts], queued_tokens: int | None,
                    unavailable: str | None) -> FleetView:
        return FleetView(
            engines=tuple(facts),
            unavailable=unavailable,
            epoch=self.ha.epoch(),
            predictive=self.cfg.admission.mode == "predictive",
            queued_tokens=self._queued_tokens if queued_tokens is None else queued_tokens,
            queued=len(self.admission.queue) if queued_tokens is None else 0,
            outputs=self.outputs.table(),
            reservations=self._live_reservations(now),
            streams_end_at=self.router.drain_until,
            over_share=self.fair.over(now),
            tripped=self._tripped(),
        )

    def _tripped(self) -> tuple[tuple[str, float], ...]:
        for name in [n for n in self.tripped if (e := self.engines.get(n)) is None or e.breaker.state == "closed"]:
            del self.tripped[name]
        return tuple(self.tripped.items())

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
        return self._unavailable_now(self._fleet_reason(now))

    def _granted_unavailable(self) -> str | None:
        """What grants and the scheduler's decisions refuse everything for: its lease and admin
        mode as they are now, its monitoring's state as read with the engines' facts (at the last
        full read, FULL_VIEW_S at most before)."""
        return self._unavailable_now(self._unavailable_fleet)

    def _unavailable_now(self, fleet_reason: str | None) -> str | None:
        if self.router.drain_until is not None:
            return "draining"  # (before the lease: a drain hands it over, and it lapses meanwhile)
        lease_mode = self.ha.lease_mode()
        if lease_mode is not None and lease_mode != "active":
            return lease_mode
        return self.router.unavailable_reason(self._waves) or fleet_reason

    def _fleet_reason(self, now: float) -> str | None:
        """The fleet's part: the router's monitoring degraded.  A look at every engine, kept while
        it is sure to hold (RouterHA.degraded_until: until time alone could change it; again at
        a monitor pass, when the fleet or its maintenance changes, and while degraded)."""
        maintenance = frozenset(self.router.maintenance)
        key = (self.ha.last_pass, self.router.started, maintenance, len(self.engines))
        kept = self._fleet_kept
        if kept is not None and kept[0] == key and now <= kept[1]:
            return None
        self._waves = {e.cfg.wave for e in self.engines.values()}
        self._fleet_kept = None
        if not self.router.started:
            return None
        why, sure = self.ha.degraded_until(self.engines.values(), now, maintenance)
        if why is not None:
            return "monitoring_degraded"
        self._fleet_kept = (key, sure)
        return None
