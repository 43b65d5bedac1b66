"""The admission decision, one pure function that both holders run: the scheduler (for its queue)
and every ingress replica (under its :class:`~narwhal_serve.admission.lease.AdmissionLease`).

``decide(view, ask, now, rotation)`` walks the contract's rows that do not depend on permits — router
unavailable (503), a prompt no engine's context holds (400), no eligible engine (503), prompt alone
over the TTFT budget and projected TTFT over the budget (429) — and, when the request may go on, returns the ranked candidate routes with
the placement record it was judged on (what the TTFT model later learns from).  Permits (retention,
queue, phase concurrency) are the permit table's (:mod:`~narwhal_serve.admission.controller`).

A holder's :class:`FleetView` is "the others as last known, plus mine exactly": the scheduler
builds it from its own ledger; an ingress from the scheduler's last grant plus its own placements
since (``FleetView.changed``, which the lease keeps as its ledger events happen).  The types it
decides on are in :mod:`.view`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.admission.predictive import judge, judge_tpot
from narwhal_serve.admission.retry import BOOKED_SHARE, RETRY_GRACE_S, Reservation, reserved_at
from narwhal_serve.errors import ContextLengthExceeded, backend_unavailable, router_unavailable
from narwhal_serve.placement.order import RouteOrder
from narwhal_serve.placement.picker import MAX_CANDIDATES
from narwhal_serve.placement.prefix import matched_blocks
from narwhal_serve.prediction.decode import expected_output, mean_remaining, tpot_at
from narwhal_serve.prediction.ttft import (
    Projection,
    decoding_requests,
    linear_ttft,
    on_idle_engine,
    projected_pair,
    released_wait_s,
    slot_wait_s,
    with_margin,
)
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.tenants.fair import OVER_SHARE_HEADROOM
from narwhal_serve.admission.view import Ask as Ask
from narwhal_serve.admission.facts import EngineDelta as EngineDelta
from narwhal_serve.admission.facts import EngineFacts as EngineFacts
from narwhal_serve.admission.view import FleetView as FleetView
from narwhal_serve.admission.view import Placement as Placement



def _first_token_engine(route: RouteChoice) -> str:
    return route.prefill.name if route.prefill else route.decode.name


@dataclass(slots=True)  # (not frozen: a frozen one takes 2.5 µs to make, and a decision makes 8 to 16)
class _Scored:
    index: int
    route: RouteChoice
    projection: Projection
    x: int  # prefill tokens at the first-token engine (uncached part of this prompt included)
    r: int
    wait: float  # the slot wait it will see (room kept for retries is judged, not predicted: they come after it)
    cached: int
    matched: int  # prompt tokens of the prefix match (``cached`` is the credited share)
    batch: float
    tpot_s: float
    tpot_known: bool
    cost: float  # expected completion time (TTFT + decode), drift-weighted: lower is better
    shed_s: float  # TPOT over budget: about how long until the decode engine sheds enough
    done: int = 0  # tokens of the prompt at the head of the line counted as prefilled already
    n: int = 0  # requests decoding at the route's decode engine when its prefill runs


def _slot_wait(d: EngineFacts | None, expected_out: float, held: int, t: float) -> float:
    """Wait for a sequence slot at the decode engine.  With a TPOT model: when the scheduler's
    releases say this one's prefill can start at its place in line (a slot freed, from each
    request's own remaining decode, and the prefills ahead of it done), that; else the requests
    beyond its slots drain ``slots`` at a time, each taking the mean remaining decode (the router's
    corrected ledger, per request) at the full-batch TPOT; before a TPOT model, the measured
    service time.
    ``held``: requests reserved there for retries, counted as already queued; ``t``: now on the
    facts' clock (the releases are times on it)."""
    if d is None:
        return 0.0
    if not d.tpot_known or not d.slots:
        return slot_wait_s(d.in_flight() + held, d.slots, d.service_s)
    per_request = mean_remaining(d.decode_tokens, d.inflight, expected_out)
    service = d.ttft_a + per_request * tpot_at(d.tpot_a, d.tpot_b, d.slots)
    if d.releases:  # the scheduler's slot releases from each request's own remaining decode
        return released_wait_s(d.releases, d.in_flight() + held + 1 - d.slots, service, d.slots, t)
    return slot_wait_s(d.in_flight() + held, d.slots, service)


def _score(view: FleetView, facts: Mapping[str, EngineFacts], i: int, route: RouteChoice, ask: Ask,
           expected_out: float, now: float, cold_tpot: tuple[float, float] | None) -> _Scored | None:
    """``cold_tpot``: the TPOT model an engine with no measurement yet is ranked with (the best
    measured one's: a cold engine must not look worse than the fleet, or it never gets the traffic
    that would measure it)."""
    e = facts.get(_first_token_engine(route))
    d = facts.get(route.decode.name)
    if e is None or d is None:
        return None
    cached = matched = 0
    if ask.prefix and e.prefix:
        matched = max(0, min(ask.prompt_tokens - 1, int(matched_blocks(e.prefix, ask.prefix) * ask.prefix_block_tokens)))
        if e.cache_block_tokens > 1:  # the engine reuses whole blocks of its own only
            matched -= matched % e.cache_block_tokens
        cached = int(matched * e.prefix_credit)
    own = ask.prompt_tokens - cached
    t = now - view.shift  # (the facts' clock)
    wait = judged_wait = _slot_wait(d, expected_out, 0, t)
    if wait > 0.0 and d is e and d.releases:
        # in line for a slot: the releases say when its prefill can start, the prompts pending
        # there when the scheduler took the view prefilled before it (each when its slot freed, in
        # order); what is left is the scheduler's queue, the prompts this holder placed there
        # since (not in the releases: added) and its own
        taken = view.taken(e.cfg.name)
        since_tokens = since_requests = 0
        if taken is not None and taken is not e:
            since_tokens = max(0, e.pending_prefill_tokens - taken.pending_prefill_tokens)
            since_requests = max(0, e.pending_prefill_requests - taken.pending_prefill_requests)
        x, r = view.queued_tokens + since_tokens + own, view.queued + since_requests
        done = 0
    else:  # behind the prompts pending there; with a slot at once, less what the head prefilled already
        done = 0 if wait or d is not e else int(e.prefilled_tokens(now - view.shift))  # (P/D: its decode engine's room too)
        x = e.pending_prefill_tokens - done + view.queued_tokens + own
        r = e.pending_prefill_requests + view.queued
    held_tokens = held_requests = held_slots = 0
    if view.reservations and not ask.retry:  # room kept for retries due before this one's first token
        held_tokens, held_requests = reserved_at(view.reservations, e.cfg.name, now, ask.ttft_budget_s)
        held_slots = held_requests if d is e else reserved_at(view.reservations, d.cfg.name, now, ask.ttft_budget_s)[1]
        if held_slots:  # judged as if they were in line before it; they come after it, so not predicted
            judged_wait = _slot_wait(d, expected_out, held_slots, t)
    alone, raw = projected_pair(e.ttft_a, e.ttft_b, x - own + held_tokens, own, judged_wait, e.ttft_c,
                                r + held_requests)
    # the prompt alone is judged with the margin of the engine's errors when idle, and so is a
    # projection onto an idle engine (then the same judgement: no wait cures a refusal); a
    # projection with work ahead or beside it, with the margin of all its errors
    n = decoding_at(d)
    idle_margin = e.ttft_margin if e.ttft_idle_margin is None else e.ttft_idle_margin
    margin = idle_margin if on_idle_engine(x - own + held_tokens, r + held_requests, n, judged_wait) else e.ttft_margin
    projection = Projection(alone, with_margin(raw, margin), with_margin(alone, idle_margin))
    batch = float(d.in_flight() + 1)
    if d.slots:
        batch = min(batch, float(d.slots))
    tpot = tpot_at(d.tpot_a, d.tpot_b, batch)
    ranked_tpot = tpot if d.tpot_known or cold_tpot is None else tpot_at(*cold_tpot, batch)
    shed = 0.0
    if (ask.tpot_budget_s is not None and d.tpot_known and tpot > ask.tpot_budget_s
            and tpot_at(d.tpot_a, d.tpot_b, 1.0) <= ask.tpot_budget_s):  # shedding load helps
        over = int((tpot - ask.tpot_budget_s) / d.tpot_b) + 1  # sequences to finish first
        per_request = mean_remaining(d.decode_tokens, d.inflight, expected_out)
        shed = over * per_request * tpot / max(batch, 1.0)
    # ranked by the projection itself; the margin is for judging it against the target
    cost = (raw + expected_out * ranked_tpot) * (1.0 + max(e.penalty, d.penalty))
    return _Scored(i, route, projection, x, r, wait, cached, matched, batch, tpot, d.tpot_known, cost, shed, done, n)


def decoding_at(d: EngineFacts) -> int:
    """Requests decoding at a route's decode engine ``d`` beside a prefill placed now (the
    first-token engine on a single-engine route; on a P/D route the prefill engine's requests in
    flight decode elsewhere, and the first token comes from ``d``'s first step)."""
    return decoding_requests(d.in_flight(), d.pending_prefill_requests)


def _tpot_ok(s: _Scored, budget: float | None) -> bool:
    return budget is None or not s.tpot_known or s.tpot_s <= budget


def _placement(ordered: tuple[RouteChoice, ...], best: _Scored | None, facts: Mapping[str, EngineFacts],
               ask: Ask, expected_out: float) -> Placement:
    if best is None:
        return Placement(ordered, None, ask.prompt_tokens, ask.prompt_tokens, 0.0, None, 0, ask.ttft_budget_s,
                         ask.kind, ask.max_output_tokens, expected_out, ordered[0].decode.name if ordered else None,
                         prefix=ask.prefix, tpot_budget_s=ask.tpot_budget_s, tenant=ask.tenant,
                         rank=ask.rank)
    e = facts[_first_token_engine(best.route)]
    predicted = best.wait + linear_ttft(e.ttft_a, e.ttft_b, best.x, e.ttft_c, best.r)
    return Placement(ordered, e.cfg.name, ask.prompt_tokens, best.x, best.wait, predicted, best.r, ask.ttft_budget_s,
                     ask.kind, ask.max_output_tokens, expected_out, best.route.decode.name, best.batch,
                     best.tpot_s if best.tpot_known else None, best.cached, best.matched, ask.prefix, ask.tpot_budget_s,
                     ask.tenant, ask.rank, best.done, best.n)


SCORED_ROUTES = 8  # predictive mode projects this many least loaded routes (and as many prefix holders)


def _ranked(view: FleetView, ask: Ask, now: float, rotation: int) -> tuple[list[RouteChoice], list[_Scored], float]:
    order = view.order(now)
    if view.predictive:
        # the least loaded few; of the engines holding the start of this prompt, the least loaded
        # few; and of those holding the most of it, the least loaded few (placement/order.py:
        # none of it scores the whole fleet)
        routes = order.top(SCORED_ROUTES, rotation, view.changed)
        every = len(routes) < SCORED_ROUTES  # (fewer routes than that: every route was scored)
        if ask.prefix and (not every or order.has_prefills):
            seen = {r.engines for r in routes}

            def add(more: list[RouteChoice]) -> None:
                for r in more:
                    if r.engines not in seen:
                        seen.add(r.engines)
                        routes.append(r)

            first = view.holding(ask.prefix[0])
            # (the deepest holders are among the first's: with few of those, all are scored)
            deepest = view.deepest(ask.prefix) if not every and len(first) > SCORED_ROUTES else frozenset()
            for holding in () if every else (first, deepest):
                add(order.top(SCORED_ROUTES, rotation, view.changed, only=holding))
            # a prefill engine holding it that is not its dialect's least loaded one: its own P/D
            # routes (else they never existed, and the prefix was prefilled again on a cold engine)
            for name in order.prefill_holders(first, SCORED_ROUTES, view.changed):
                add(order.over(name, SCORED_ROUTES, rotation, view.changed))
    else:
        routes = order.top(MAX_CANDIDATES, rotation, view.changed)
    routes = _roomy(view, order, routes, ask, rotation)
    expected_out = expected_output(view.outputs, ask.kind, ask.max_output_tokens, view.output_prior,
                                   ask.min_output_tokens)
    if not routes:
        return routes, [], expected_out
    facts, cold = view.facts(), view.cold_tpot()
    scored = [s for i, r in enumerate(routes)
              if (s := _score(view, facts, i, r, ask, expected_out, now, cold)) is not None]
    return routes, scored, expected_out


def _room_needed(ask: Ask) -> int:
    """The prompt length an engine's context must hold for ``ask`` (0: nothing known to check).
    (A context fits a prompt of p tokens when longer, an output limit or a truncation of m tokens
    when as long: each as p = m - 1.)"""
    return max(ask.prompt_tokens if ask.exact else 0, (ask.max_output_tokens or 0) - 1, ask.truncate_to - 1)


def _roomy(view: FleetView, order: RouteOrder[EngineFacts], routes: list[RouteChoice], ask: Ask,
           rotation: int) -> list[RouteChoice]:
    """``routes`` without those the request does not fit (an engine of the route said a context an
    exactly sized prompt would fill, or shorter than the output limit asked); when none of these
    is left, the least loaded of the routes it fits; when there are none such either (a P/D order
    pairs each decode engine with one prefill engine), ``routes`` as they are: the engine answers.
    Free unless the prompt is as long as the shortest context said, or the limit longer."""
    n = _room_needed(ask)
    context = view.context()
    if not n or not context.shortest or n < context.shortest:
        return routes
    facts = view.facts()

    def fits(r: RouteChoice) -> bool:
        return all(facts[e].holds(n) for e in r.engines)

    kept = [r for r in routes if fits(r)]
    if not kept:  # (a rare walk: a prompt only the fleet's longer contexts take)
        kept = [r for r in order.top(len(routes) or MAX_CANDIDATES, rotation, view.changed, only=context.room(n))
                if fits(r)]
    return kept or routes


TIE_S = 0.001  # expected completion times in the same millisecond are a tie: the ingress's own node breaks it


def _near(s: _Scored, node: str | None, facts: Mapping[str, EngineFacts]) -> tuple[float, ...]:
    """The cost part of the ranking: the cost itself; with the ingress's node known, first the cost's
    millisecond and whether the route's engines are off that node (a request whose engines
    share the ingress's node skips a network hop each way, for every token).  On one node, or with
    no managed engine, every route is as near as another and the order is the cost's alone."""
    if node is None:
        return (s.cost,)
    off = any((f := facts.get(n)) is None or f.node != node for n in s.route.engines)
    bucket = math.floor(s.cost / TIE_S) if math.isfinite(s.cost) else s.cost
    return (bucket, off, s.cost)


SPILL_SHARE = 0.5  # a spill that loses the cached prefix of at least this share of the prompt is guarded


def _guarded_spill(s: _Scored, held: int, ask: Ask, facts: Mapping[str, EngineFacts]) -> bool:
    """Whether placing on ``s`` would spill a prompt away from the engine holding its prefix
    (``held`` credited tokens there; ``s`` at least ``SPILL_SHARE`` of the prompt fewer) onto an
    engine with no free sequence slot.  Such a spill costs that engine the whole prefill again
    (for a long shared prefix, several cached requests' worth of its time) and plants the prefix
    there, evicting others' that its own traffic would have hit: under saturation it lowers
    goodput.  So a guarded spill ranks last: the request goes to its holder, or is judged (and
    refused, with an honest Retry-After) on the holder's projection.  An engine with a free slot
    may take the spill (the slot would idle otherwise; a hot prefix spreads this way)."""
    if (held - s.cached) < SPILL_SHARE * ask.prompt_tokens:
        return False
    e = facts[_first_token_engine(s.route)]
    return e.slots is not None and 0 < e.slots <= e.in_flight()


def _rank(view: FleetView, ask: Ask, now: float, rotation: int
          ) -> tuple[Placement | None, _Scored | None, list[_Scored]]:
    routes, scored, expected_out = _ranked(view, ask, now, rotation)
    if not routes:
        return None, None, []
    facts = view.facts()
    if not scored:
        return _placement(tuple(routes[:MAX_CANDIDATES]), None, facts, ask, expected_out), None, []
    if view.predictive:
        # a guarded spill (below) last; within the targets, the engine holding the longest prefix
        # of the prompt first (its cache is worth more than a shorter queue elsewhere as long as
        # the targets hold), then cost
        held = max(s.cached for s in scored)
        scored.sort(key=lambda s: (_guarded_spill(s, held, ask, facts), not _tpot_ok(s, ask.tpot_budget_s),
                                   s.projection.projected_s > ask.ttft_budget_s - ask.waited_s, -s.matched,
                                   *_near(s, ask.node, facts), s.index))
        best = scored[0]
        # a route over the TPOT target takes no new work (admitted streams keep their speed)
        ordered = tuple(s.route for s in scored if _tpot_ok(s, ask.tpot_budget_s))[:MAX_CANDIDATES] or (best.route,)
    else:
        ordered = tuple(routes[:MAX_CANDIDATES])
        best = next((s for s in scored if s.route is ordered[0]), scored[0])
    return _placement(_spare_prefill(view, ordered, ask, facts, now), best, facts, ask, expected_out), best, scored


def _spare_prefill(view: FleetView, ordered: tuple[RouteChoice, ...], ask: Ask, facts: Mapping[str, EngineFacts],
                   now: float) -> tuple[RouteChoice, ...]:
    """``ordered`` with a way past its prefill engine: P/D routes pair every decode engine with the
    least loaded prefill engine of their dialect, so when each route goes through one prefill
    engine, a failure or a refusal of it (a 5xx, a reset, a busy 429/503: the relay leaves that
    engine out of the later routes) would end the request while another prefill engine is
    eligible. The last route then goes over the next least loaded prefill engine whose context
    holds the request (with the last route's decode engine: the decode engines tried stay the
    same), as vLLM's own proxy picks a prefill engine apart from the decode one. The first route,
    and so the prediction and the charges, stay as they are."""
    prefills = {r.prefill.name if r.prefill is not None else None for r in ordered}
    if len(prefills) != 1 or None in prefills:  # (a unified route, or a second prefill engine: a way past it)
        return ordered
    first, last = ordered[0], ordered[-1]
    assert first.prefill is not None
    n = _room_needed(ask)
    other = view.order(now).other_prefill(first.decode.dialect, first.prefill.name, view.changed,
                                          fits=lambda name: facts[name].holds(n))
    if other is None:
        return ordered
    spare = RouteChoice(kind="pd", decode=last.decode, prefill=other)
    return (*ordered, spare) if len(ordered) < MAX_CANDIDATES else (*ordered[:-1], spare)


def rank(view: FleetView, ask: Ask, now: float, rotation: int) -> tuple[Placement | None, Projection | None]:
    """Candidate routes, best first, with the placement record of the best; ``(None, None)`` when
    no engine is eligible.  Predictive mode orders by expected completion time (projected TTFT,
    prefix credit included, plus expected output × projected TPOT, drift-weighted), routes within
    the TTFT and TPOT budgets first; open mode by load."""
    placement, best, _ = _rank(view, ask, now, rotation)
    return placement, None if best is None else best.projection


def decide(view: FleetView, ask: Ask, now: float, rotation: int) -> Placement | Refusal:
    """The contract's non-permit rows, in order; a :class:`Placement` when the request may go on."""
    if view.unavailable is not None:
        return Refusal(router_unavailable(view.unavailable), Outcome.REJECTED)
    context = view.context()
    if context.every:  # (what vLLM 0.32 refuses before any engine would, in this order)
        if ask.max_output_tokens is not None and ask.max_output_tokens > context.longest:
            return Refusal(ContextLengthExceeded.output(ask.output_param, ask.max_output_tokens, context.longest).info(),
                           Outcome.INVALID)
        if ask.truncate_to > context.longest:
            return Refusal(ContextLengthExceeded.truncation(ask.truncate_to, context.longest).info(), Outcome.INVALID)
        if ask.exact and ask.prompt_tokens >= context.longest:  # no engine leaves it room for an output token
            return Refusal(ContextLengthExceeded.of(ask.kind, ask.prompt_tokens, context.longest).info(), Outcome.INVALID)
    placement, best, scored = _rank(view, ask, now, rotation)
    if placement is None:
        return Refusal(backend_unavailable(), Outcome.REJECTED)
    if view.predictive and best is not None:
        own = ask.ttft_budget_s if ask.admit_within_s is None else min(ask.ttft_budget_s, ask.admit_within_s)
        limit = own
        if view.over_share and ask.tenant in view.over_share:  # the rest is for tenants within theirs (for a
            limit = min(limit, OVER_SHARE_HEADROOM * ask.ttft_budget_s)  # while: the prompt alone is judged on its own)
        refusal = judge(best.projection, limit, own, ask.waited_s)
        if refusal is not None:
            retry_after = refusal.error.retry_after
            if ask.reserves and retry_after is not None:
                due = now + retry_after
                name = _first_token_engine(best.route)
                tokens = max(0, ask.prompt_tokens - best.cached)
                booked_tokens, booked = reserved_at(view.reservations, name, due, 0.0)  # live and due by then
                e = view.facts()[name]
                if linear_ttft(e.ttft_a, e.ttft_b, booked_tokens + tokens, e.ttft_c, booked) \
                        <= BOOKED_SHARE * ask.ttft_budget_s:  # room for it is not booked up already
                    return replace(refusal, reserve=Reservation("", name, due, due + RETRY_GRACE_S, tokens))
            return refusal
        if not _tpot_ok(best, ask.tpot_budget_s):
            assert ask.tpot_budget_s is not None
            return judge_tpot(best.tpot_s, ask.tpot_budget_s, min((s.shed_s for s in scored if s.shed_s > 0), default=None))
    return placement
