"""The admission decision, one pure function that both holders run: the scheduler (for its queue)
and every ingress replica (under its :class:`~narwhal_serve.admission.lease.AdmissionLease`).

``decide(view, ask, now, rotation)`` walks the seed's rows that do not depend on permits — router
unavailable (503), no eligible engine (503), prompt alone over the TTFT budget and projected TTFT
over the budget (429) — and, when the request may go on, returns the ranked candidate routes with
the placement record it was judged on (what the TTFT model later learns from).  Permits (retention,
queue, phase concurrency) are the permit table's (:mod:`~narwhal_serve.admission.controller`).

A holder's :class:`FleetView` is "the others as last known, plus mine exactly": the scheduler
builds it from its own ledger; an ingress from the scheduler's last grant plus its own placements
since (:meth:`FleetView.adjusted`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.admission.outcomes import Outcome
from narwhal_serve.admission.predictive import judge
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.ha.state import backend_unavailable, router_unavailable
from narwhal_serve.placement.picker import candidate_routes
from narwhal_serve.prediction.ttft import Projection, linear_ttft, project_linear, slot_wait_s
from narwhal_serve.protocol.placement import RouteChoice


@dataclass(frozen=True)
class EngineFacts:
    """What a decision needs to know about one engine (a frozen copy of the scheduler's state)."""

    cfg: EngineConfig
    eligible_until: float  # eligible (healthy, fresh metrics, not in maintenance) until this time; 0 = not
    inflight: int  # requests routed here and not seen end
    load: EngineLoad  # last scrape
    pending_prefill_tokens: int  # prompt tokens routed here and not yet past their first token
    ttft_a: float
    ttft_b: float
    slots: int | None
    service_s: float | None
    external: int = 0  # requests from other clients, as last scraped (EngineState.external)
    pending_prefill_requests: int = 0  # requests routed here and not yet past their first token
    ttft_c: float = 0.0  # seconds per request ahead

    def eligible(self, now: float) -> bool:
        return now <= self.eligible_until

    def in_flight(self) -> int:
        """Requests at the engine now: the router's own (exact), plus others' as last scraped."""
        return self.inflight + self.external


@dataclass(frozen=True)
class EngineDelta:
    inflight: int = 0
    pending_prefill_tokens: int = 0
    pending_prefill_requests: int = 0

    def __add__(self, other: "EngineDelta") -> "EngineDelta":
        return EngineDelta(
            self.inflight + other.inflight,
            self.pending_prefill_tokens + other.pending_prefill_tokens,
            self.pending_prefill_requests + other.pending_prefill_requests,
        )


@dataclass(frozen=True)
class FleetView:
    engines: tuple[EngineFacts, ...]
    unavailable: str | None  # the router-state reason it refuses everything, or None
    predictive: bool
    queued_tokens: int = 0  # prompt tokens waiting in the scheduler's queue
    queued: int = 0  # requests waiting in the scheduler's queue
    epoch: int = 0  # the router lease's fencing token (0: no lease backend), sent to engines

    def adjusted(self, deltas: Mapping[str, EngineDelta]) -> "FleetView":
        """This view with a holder's own changes since it was taken."""
        if not deltas:
            return self
        engines = tuple(
            replace(
                e,
                inflight=max(0, e.inflight + d.inflight),
                pending_prefill_tokens=max(0, e.pending_prefill_tokens + d.pending_prefill_tokens),
                pending_prefill_requests=max(0, e.pending_prefill_requests + d.pending_prefill_requests),
            )
            if (d := deltas.get(e.cfg.name)) is not None
            else e
            for e in self.engines
        )
        return replace(self, engines=engines)

    def shifted(self, dt: float) -> "FleetView":
        """The view with its times moved by ``dt`` (into another process's clock)."""
        return replace(self, engines=tuple(replace(e, eligible_until=e.eligible_until + dt) for e in self.engines))


@dataclass(frozen=True)
class Ask:
    prompt_tokens: int
    ttft_budget_s: float


@dataclass(frozen=True)
class Placement:
    """An admitted request's ranked routes, and the numbers its admission was judged on."""

    routes: tuple[RouteChoice, ...]
    first_engine: str | None  # the engine whose prefill gives the first token on routes[0]
    prompt_tokens: int
    x_tokens: int  # prefill tokens at that engine, this prompt included
    slot_wait_s: float  # the queueing part of the prediction
    predicted_s: float | None
    r_ahead: int = 0  # requests waiting for prefill at that engine, ahead of this one
    ttft_budget_s: float | None = None  # the request's TTFT target (goodput: first token within it)

    @property
    def engines(self) -> tuple[str, ...]:
        return self.routes[0].engines if self.routes else ()


def _first_token_engine(route: RouteChoice) -> str:
    return route.prefill.name if route.prefill else route.decode.name


def _facts(view: FleetView) -> dict[str, EngineFacts]:
    return {e.cfg.name: e for e in view.engines}


def _slot_wait(facts: Mapping[str, EngineFacts], route: RouteChoice) -> float:
    d = facts.get(route.decode.name)
    return 0.0 if d is None else slot_wait_s(d.in_flight(), d.slots, d.service_s)


def _project(
    view: FleetView, facts: Mapping[str, EngineFacts], route: RouteChoice, prompt: int
) -> tuple[Projection, int, int, float] | None:
    e = facts.get(_first_token_engine(route))
    if e is None:
        return None
    x = e.pending_prefill_tokens + view.queued_tokens + prompt
    r = e.pending_prefill_requests + view.queued
    wait = _slot_wait(facts, route)
    return project_linear(e.ttft_a, e.ttft_b, x - prompt, prompt, wait, e.ttft_c, r), x, r, wait


def rank(
    view: FleetView, prompt_tokens: int, now: float, rotation: int, ttft_budget_s: float | None = None
) -> tuple[Placement | None, Projection | None]:
    """Candidate routes, best first (projected TTFT in predictive mode, else load), with the
    placement record of the best; ``(None, None)`` when no engine is eligible."""
    routes = candidate_routes([e for e in view.engines if e.eligible(now)], rotation)
    if not routes:
        return None, None
    facts = _facts(view)
    scored = [(i, r, _project(view, facts, r, prompt_tokens)) for i, r in enumerate(routes)]
    if view.predictive:
        scored.sort(key=lambda s: (s[2][0].projected_s if s[2] else float("inf"), s[0]))
    _, best, proj = scored[0]
    ordered = tuple(s[1] for s in scored)
    if proj is None:
        return Placement(ordered, None, prompt_tokens, prompt_tokens, 0.0, None, 0, ttft_budget_s), None
    projection, x, r, wait = proj
    e = facts[_first_token_engine(best)]
    predicted = wait + linear_ttft(e.ttft_a, e.ttft_b, x, e.ttft_c, r)
    return Placement(ordered, e.cfg.name, prompt_tokens, x, wait, predicted, r, ttft_budget_s), projection


def decide(view: FleetView, ask: Ask, now: float, rotation: int) -> Placement | Refusal:
    """The seed's non-permit rows, in order; a :class:`Placement` when the request may go on."""
    if view.unavailable is not None:
        return Refusal(router_unavailable(view.unavailable), Outcome.REJECTED)
    placement, projection = rank(view, ask.prompt_tokens, now, rotation, ask.ttft_budget_s)
    if placement is None:
        return Refusal(backend_unavailable(), Outcome.REJECTED)
    if view.predictive and projection is not None:
        refusal = judge(projection, ask.ttft_budget_s)
        if refusal is not None:
            return refusal
    return placement


def charge(placement: Placement) -> dict[str, EngineDelta]:
    """What admitting ``placement`` adds to each engine's counts."""
    out = {name: EngineDelta(inflight=1) for name in placement.engines}
    if placement.first_engine is not None:
        out[placement.first_engine] = out.get(placement.first_engine, EngineDelta()) + EngineDelta(
            pending_prefill_tokens=placement.prompt_tokens, pending_prefill_requests=1
        )
    return out
