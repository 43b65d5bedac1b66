"""What the scheduler knows about each engine, and which engines may take a request."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.managed.slot import ManagedSlot
from narwhal_serve.placement.drift import Drift
from narwhal_serve.placement.health import Breaker
from narwhal_serve.placement.prefix import CREDIT_PRIOR, PrefixIndex
from narwhal_serve.prediction.decode import TpotModel
from narwhal_serve.prediction.ttft import (
    IDLE_ERRORS_MIN, PRIOR_A, PRIOR_B, ErrorWindow, Gram, PrefillModel, decoding_requests, fit_prefill, linear_ttft,
)

PREFIX_INDEX_BLOCKS = 4096  # config.PlacementConfig.prefix_index_blocks (the scheduler sets it)


@dataclass
class EngineState:
    cfg: EngineConfig
    healthy: bool = False
    last_ok: float | None = None  # when /health and /metrics last both answered
    last_answer: float | None = None  # when a scrape last got any definitive answer (refused, 503, 200)
    load: EngineLoad = field(default_factory=EngineLoad)
    inflight: int = 0  # requests the router has routed here and not yet seen end
    inflight_at_scrape: int = 0  # ``inflight`` when the last /metrics answer arrived
    failures: int = 0  # consecutive scrape failures
    tpot_s: float | None = None  # measured time per output token (EWMA)
    tpot_model: TpotModel = field(default_factory=TpotModel)  # TPOT against the running batch
    decode_tokens: float = 0.0  # decode tokens still ahead of the router's requests here (corrected ledger)
    drift: Drift = field(default_factory=Drift)  # measured against its own models; out while re-measured
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(PREFIX_INDEX_BLOCKS))
    ttft_errors: ErrorWindow = field(default_factory=ErrorWindow)  # the margin a projection is judged with
    # the errors of requests placed on it idle (Placement.idle), the margin the prompt alone is judged with
    ttft_idle_errors: ErrorWindow = field(default_factory=ErrorWindow)
    prefix_credit: float = CREDIT_PRIOR  # share of believed prefix hits that measured like hits (EWMA)
    prefix_exact: bool = False  # the index follows the engine's own KV events (credit 1, not learned)
    cache_block_tokens: int = 0  # the engine's KV block size, from its events (credits round down to it)
    pending_prefill_tokens: int = 0  # prompt tokens routed here and not yet past their first token
    pending_prefill_requests: int = 0  # requests routed here and not yet past their first token
    # those requests' tickets in the order they came (their prompt tokens), and since when the one
    # at the head prefills (when it became the head: the clock of the ledger's events)
    prefill_line: dict[str, int] = field(default_factory=dict)
    line_since: float | None = None
    service_s: float | None = None  # measured request duration, first byte to last token (EWMA)
    max_running_seen: int = 0
    queued_seen: bool = False  # a scrape has shown it queueing (its slots full): max_running_seen is its limit
    ttft_model: PrefillModel = field(default_factory=PrefillModel)
    breaker: Breaker = field(default_factory=Breaker)  # passive health (real attempts' outcomes)
    managed: ManagedSlot | None = None  # a Ray-managed engine's replica, node and state (None: a URL engine)
    # its context length, from its /v1/models (``max_model_len``; 0: not said); asked again each
    # time it comes up and every minute (a restarted engine may have another), the last one said
    # kept meanwhile (an engine down for a moment must not leave the fleet's context unknown)
    context: int = 0
    context_asked: float | None = None  # when it last answered the question since it came up (None: not since)

    def __post_init__(self) -> None:
        self.ttft_model = PrefillModel(
            prior_a=PRIOR_A if self.cfg.ttft_prior_a_s is None else self.cfg.ttft_prior_a_s,
            prior_b=PRIOR_B if self.cfg.ttft_prior_b_s_per_token is None else self.cfg.ttft_prior_b_s_per_token,
        )

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return self.last_ok is not None and now - self.last_ok <= stale_after_s

    def answered(self, now: float, stale_after_s: float) -> bool:
        """The router knows this engine's state: fresh metrics, or a recent definite "down"
        (refused connection, unhealthy) — not a scrape that hangs (monitoring-degraded counts these)."""
        return self.fresh(now, stale_after_s) or (self.last_answer is not None and now - self.last_answer <= stale_after_s)

    def eligible(self, now: float, stale_after_s: float, maintenance: frozenset[str]) -> bool:
        """Healthy, with fresh metrics (stale counts as unusable), not in a maintenance wave, its
        breaker closed and not pushing back, not out for drift; a managed engine also up (its process running)."""
        return (self.healthy and self.fresh(now, stale_after_s) and self.cfg.wave not in maintenance
                and self.breaker.takes_work(now) and not self.drift.out
                and (self.managed is None or self.managed.up))

    def slots(self) -> int | None:
        """Concurrent sequences the engine runs: configured, or, once a scrape has shown it queueing,
        the most seen running.  Learned once and kept (not only while the last scrape shows a
        queue: a line that forms between two scrapes is what a slot wait is for)."""
        if self.cfg.max_num_seqs:
            return self.cfg.max_num_seqs
        if self.queued_seen and self.max_running_seen > 0:
            return self.max_running_seen
        return None

    def external(self) -> int:
        """Requests at the engine the router did not send (other clients), as of the last scrape:
        what the engine reported beyond the router's own count *at that moment*.  The router's
        ledger is exact and immediate; a scrape only adds what the ledger cannot see, so a scrape
        older than the router's last change never overrides it (a drained burst is drained)."""
        return max(0, int(self.load.running + self.load.waiting) - self.inflight_at_scrape)

    def in_flight(self) -> int:
        """Requests at the engine now: the router's own, plus others' as last scraped."""
        return self.inflight + self.external()

    def idle_margin(self) -> float:
        """The margin the prompt alone, and a projection onto this engine idle, are judged with: of
        the errors of requests placed on it idle, once IDLE_ERRORS_MIN are in; the margin of all
        its errors before."""
        idle = self.ttft_idle_errors
        return idle.margin if len(idle.errors) >= IDLE_ERRORS_MIN else self.ttft_errors.margin

    def decoding(self) -> int:
        """Requests decoding here beside a prefill placed now (admission/core.py ``decoding_at``): on
        a prefill engine none (its requests in flight decode on their decode engines)."""
        if self.cfg.role == "prefill":
            return 0
        return decoding_requests(self.in_flight(), self.pending_prefill_requests)

    def configure(self, cfg: NarwhalConfig) -> "EngineState":
        """What the router's config sets on an engine's state when it joins the fleet (at start, an
        engine added, a managed engine's extra slot): its prefix index's capacity and the confidence
        of its margins."""
        self.prefix.capacity = cfg.placement.prefix_index_blocks
        self.ttft_errors.quantile = self.ttft_idle_errors.quantile = cfg.admission.ttft_confidence
        return self

    def token_accounting(self) -> str:
        return "token_ids" if self.cfg.dialect == "vllm" else "unavailable"

    def view(self, now: float, stale_after_s: float, maintenance: frozenset[str]) -> dict[str, object]:
        return {
            "name": self.cfg.name,
            "url": self.cfg.url,
            "role": self.cfg.role,
            "dialect": self.cfg.dialect,
            "wave": self.cfg.wave,
            "healthy": self.healthy,
            "eligible": self.eligible(now, stale_after_s, maintenance),
            "metrics_age_s": None if self.last_ok is None else round(now - self.last_ok, 3),
            "maintenance": self.cfg.wave in maintenance,
            "draining": self.cfg.wave in maintenance and self.inflight > 0,
            "running": self.load.running,
            "waiting": self.load.waiting,
            "kv_cache_usage": self.load.kv_usage,
            "inflight": self.inflight,
            "tpot_s": self.tpot_s,
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "pending_prefill_requests": self.pending_prefill_requests,
            "decoding_requests": self.decoding(),
            "slots": self.slots(),
            "max_model_len": self.context or None,  # its /v1/models (null: not said)
            "service_s": self.service_s,
            "decode_tokens_ahead": round(self.decode_tokens, 1),
            "tpot_model": {"a_s": self.tpot_model.a, "b_s_per_sequence": self.tpot_model.b,
                           "samples": len(self.tpot_model.samples)},
            "prefix_index_blocks": len(self.prefix),
            "prefix_index_capacity": self.prefix.capacity,
            "prefix_credit": round(self.prefix_credit, 4),
            "prefix_source": "kv_events" if self.prefix_exact else "learned",
            **self.drift.view(now),
            "ttft_model": {"a_s": self.ttft_model.a, "b_s_per_token": self.ttft_model.b,
                           "c_s_per_request_ahead": self.ttft_model.c,
                           "samples": len(self.ttft_model.samples), "prior_a_s": self.ttft_model.prior_a,
                           "margin": round(self.ttft_errors.margin, 4),
                           "idle_margin": round(self.idle_margin(), 4),
                           "prior_b_s_per_token": self.ttft_model.prior_b},
            "token_accounting": self.token_accounting(),
            "managed": self.managed is not None,
            "placement": None if self.managed is None else self.managed.view(now),
            **self.breaker.view(now),
        }


def fleet_ttft(engines: Iterable[EngineState]) -> dict[tuple[str, str], PriorCoeffs]:
    """Per role and dialect, the TTFT model fitted to every measurement of the engines of that kind
    (their windows' sums pooled, with the generic prior): what an engine with no measurement of its
    own and no prior from its operator is projected with (a generic prior would make it look
    faster or slower than the fleet it joins; at a thousand engines most are such, and a too slow
    prior refused their long prompts as over the budget on their own).  Pooled, not the model of
    the engine with the most samples: that one fit moved by a third when its engine refitted, and
    every move re-granted hundreds of engines' facts."""
    measured: dict[tuple[str, str], list[list[float]]] = {}
    for e in engines:
        if e.ttft_model.samples:
            measured.setdefault((e.cfg.role, e.cfg.dialect), []).append(e.ttft_model.gram.sums)
    out: dict[tuple[str, str], PriorCoeffs] = {}
    for kind, all_sums in measured.items():
        g = Gram(3)
        g.sums = [math.fsum(column) for column in zip(*all_sums)]  # (a pass in C per sum, not a list per engine)
        out[kind] = PriorCoeffs(*fit_prefill(g))
    return out


class PriorCoeffs(NamedTuple):
    """A TTFT model's coefficients as read at one moment (the fleet's prior granted to leases)."""

    a: float
    b: float
    c: float


# per role and dialect, the TTFT model an engine without a measurement is projected with
FleetPrior = Mapping[tuple[str, str], PrefillModel | PriorCoeffs]

# The fleet's prior as granted is kept while the fleet's model projects within PRIOR_TOLERANCE of
# it, plus PRIOR_FLOOR_S, for every prompt of 1 to PRIOR_SPAN[0] tokens behind 0 to PRIOR_SPAN[1]
# requests (an engine that borrows the prior has had few requests, if any): pooled over the fleet
# it moves a little with every measurement, and each new one is a new row for each engine
# borrowing it (most, at a thousand engines) to every lease.
PRIOR_TOLERANCE = 0.01
PRIOR_FLOOR_S = 0.005
PRIOR_SPAN = (131072.0, 8.0)


def settled_prior(kept: PriorCoeffs | None, fresh: PriorCoeffs) -> PriorCoeffs:
    """``kept`` while ``fresh`` projects within PRIOR_TOLERANCE of it plus PRIOR_FLOOR_S everywhere
    in PRIOR_SPAN, else ``fresh``.  (Both bounds of the difference are linear in the prompt and the
    requests ahead, so they hold in the whole box when they hold at its corners.)"""
    if kept is None:
        return fresh
    for x in (1.0, PRIOR_SPAN[0]):
        for r in (0.0, PRIOR_SPAN[1]):
            was = linear_ttft(kept.a, kept.b, x, kept.c, r)
            if abs(linear_ttft(fresh.a, fresh.b, x, fresh.c, r) - was) > PRIOR_TOLERANCE * was + PRIOR_FLOOR_S:
                return fresh
    return kept


def borrows_ttft(e: EngineState) -> bool:
    """Whether ``e`` is projected with the fleet's TTFT model (:func:`fleet_ttft`) rather than its own."""
    return not e.ttft_model.samples and e.cfg.ttft_prior_a_s is None and e.cfg.ttft_prior_b_s_per_token is None


def adopt_fleet_prior(e: EngineState, engines: Iterable[EngineState], granted: FleetPrior | None = None) -> None:
    """Before an engine's first measurement: its model starts from the fleet's (its prior too, so its
    first samples are weighed against what the fleet measured, not a generic guess).  ``granted``:
    the scheduler's prior as last granted with the fleet's facts (what ``e`` was projected with until
    now; no look at every engine per engine's first measurement); without it, or before its kind is
    in it (a start, two new engines in one report), :func:`fleet_ttft` over ``engines``."""
    if not borrows_ttft(e):
        return
    kind = (e.cfg.role, e.cfg.dialect)
    m = granted.get(kind) if granted is not None else None
    if m is None:
        m = fleet_ttft(engines).get(kind)
    if m is not None:
        e.ttft_model.prior_a, e.ttft_model.prior_b = m.a, m.b
        e.ttft_model.a, e.ttft_model.b, e.ttft_model.c = m.a, m.b, m.c
