"""The bookkeeping after an admission decision: one copy, for the scheduler and the ingress lease.

A decision (:func:`narwhal_serve.admission.core.decide`) places a request; from then on the fleet's
counts must carry it until it ends: one request in flight on each engine of the route it is
charged to, its prompt as pending prefill (and its blocks as a pending prefix) on its first-token
engine until its first token, and its expected remaining output on its decode engine, corrected as
its tokens arrive. A :class:`Ticket` is one admitted request's share of those counts; each event
below updates it and returns what changed, per engine, as :class:`EngineDelta`\\ s:

- the scheduler applies them to its engines' live state at once (``scheduler/tickets.py``);
- a lease adds them up into its view's adjustments until the scheduler's next grant
  (``admission/lease.py``).

Every event is idempotent where a request can meet it twice (a second first token after a resume
moves the charge; a prefill already done stays done).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from narwhal_serve.admission.core import EngineDelta, Placement
from narwhal_serve.prediction.decode import remaining_tokens
from narwhal_serve.prediction.ttft import RELEASES_MAX, slot_releases

Deltas = dict[str, EngineDelta]


@dataclass
class Ticket:
    """One admitted request's charges."""

    placement: Placement  # what its admission was judged on
    engines: tuple[str, ...] = ()  # where its in-flight count is charged (set by admitted; moves to the route served)
    prefill_done: bool = False
    decode_engine: str | None = None  # where its decode work is charged
    decode_charged: float = 0.0  # that charge, corrected as its tokens arrive
    # when that charge was last set from its tokens (its first token, its progress, as the holder
    # heard them; its clock, None: not told) and how many it had then: its decode runs on from there
    # (:func:`releases`)
    charged_at: float | None = None
    charged_tokens: float = 0.0


def add(into: Deltas, more: Mapping[str, EngineDelta]) -> None:
    """``more`` added into ``into``, engine by engine."""
    for name, d in more.items():
        was = into.get(name)
        into[name] = d if was is None else was + d


def charge(placement: Placement) -> dict[str, EngineDelta]:
    """What admitting ``placement`` adds to each engine's counts.  Its prompt's blocks count as held
    by its first-token engine from now on (a *pending prefix*): a request with the same prefix is
    placed behind it there and finds the blocks cached when its own prefill starts, instead of
    spilling cold onto another engine while the first prefill runs."""
    engines, first, decode = placement.engines, placement.first_engine, placement.decode_engine
    out = {}
    for name in engines if first is None or first in engines else engines + (first,):
        pending = name == first
        out[name] = EngineDelta(  # one each (an admission makes them for every request)
            inflight=1 if name in engines else 0,
            pending_prefill_tokens=placement.prefill_tokens if pending else 0,
            pending_prefill_requests=1 if pending else 0,
            decode_tokens=placement.expected_out if name == decode else 0.0,
            prefix=frozenset(placement.prefix) if pending else frozenset(),
        )
    return out


def admitted(t: Ticket) -> Deltas:
    """A new ticket's charges (:func:`charge` of its placement)."""
    p = t.placement
    out = charge(p)
    t.engines, t.prefill_done = p.engines, False
    t.decode_engine = p.decode_engine
    t.decode_charged = p.expected_out if p.decode_engine is not None and p.decode_engine in out else 0.0
    return out


def _recharge(t: Ticket, engine: str | None, amount: float, out: Deltas) -> None:
    """The ticket's decode charge becomes ``amount`` on ``engine`` (None: none)."""
    if t.decode_engine is not None and t.decode_charged:
        add(out, {t.decode_engine: EngineDelta(decode_tokens=-t.decode_charged)})
    t.decode_engine, t.decode_charged = engine, 0.0
    if engine is not None and amount:
        add(out, {engine: EngineDelta(decode_tokens=amount)})
        t.decode_charged = amount


def moved(t: Ticket, engines: tuple[str, ...]) -> Deltas:
    """The route that actually served it is ``engines`` (a retry or a resume moved it there)."""
    out: Deltas = {}
    if engines and engines != t.engines:
        add(out, {n: EngineDelta(inflight=-1) for n in t.engines})
        add(out, {n: EngineDelta(inflight=1) for n in engines})
        t.engines = engines
        _recharge(t, engines[-1], t.decode_charged, out)
    return out


def prefill_finished(t: Ticket) -> Deltas:
    """Its prefill is done (its first token came, or it ended): the pending prefill and prefix go."""
    if t.prefill_done:
        return {}
    t.prefill_done = True
    p = t.placement
    if p.first_engine is None:
        return {}
    return {p.first_engine: EngineDelta(pending_prefill_tokens=-p.prefill_tokens, pending_prefill_requests=-1,
                                        prefix_done=frozenset(p.prefix), prefills_done=1)}


def first_token(t: Ticket, engines: tuple[str, ...], now: float | None = None) -> Deltas:
    """Its first token came from ``engines`` (again later: a resume moved the answer there), at
    ``now`` (its decode starts running down then)."""
    out = moved(t, engines)
    add(out, prefill_finished(t))
    if now is not None and t.charged_at is None:
        t.charged_at, t.charged_tokens = now, 1.0
    return out


def progressed(t: Ticket, tokens: int, now: float | None = None) -> Deltas:
    """Decode correction: its remaining decode from the ``tokens`` it generated so far (counted
    ``now``)."""
    out: Deltas = {}
    p = t.placement
    _recharge(t, t.decode_engine, remaining_tokens(p.expected_out, tokens, p.max_output_tokens), out)
    if now is not None:
        t.charged_at, t.charged_tokens = now, float(tokens)
    return out


def released(t: Ticket) -> Deltas:
    """It ended: every charge it still holds goes."""
    out = prefill_finished(t)
    add(out, {n: EngineDelta(inflight=-1) for n in t.engines})
    _recharge(t, None, 0.0, out)
    return out


def releases(tickets: Iterable[Ticket], slots: int, external: int, first_s: float, tpot_s: float,
             more_s: float, per_token_s: float = 0.0, per_request_s: float = 0.0, *,
             now: float) -> tuple[float, ...]:
    """When each of the next requests beyond a decode engine's ``slots`` can start its prefill
    (``prediction/ttft.py`` :func:`slot_releases`), as times on the clock of ``now`` (the
    tickets'), from the ``tickets`` decoding there in the order they came: one past its first
    token holds a slot for its remaining decode at ``tpot_s`` a token (its charge; once its tokens
    were counted, what :func:`remaining_tokens` leaves of its expected output after those and the
    ones made at ``tpot_s`` since — one past its expected length still holds its slot, for a
    quarter of what it made), one before it is in line for its prefill there (``per_token_s`` a
    pending token plus ``per_request_s``; none when another engine prefills it), then ``first_s``
    and its expected decode; other clients' ``external`` requests take ``more_s`` each (their
    lengths are unknown): as many as the slots left hold them, the rest wait in line first (they
    are at the engine already; their prefills unknown); so do the requests after the known ones.
    Empty while the engine has a free slot for the next one."""
    running: list[float] = []
    queued: list[float] = []
    prefill: list[float] = []
    for t in tickets:
        if t.prefill_done:
            if t.charged_at is None or tpot_s <= 0.0:
                running.append(t.decode_charged * tpot_s)
            else:
                made = t.charged_tokens + max(0.0, now - t.charged_at) / tpot_s
                p = t.placement
                running.append(remaining_tokens(p.expected_out, made, p.max_output_tokens) * tpot_s)
        else:
            queued.append(first_s + t.decode_charged * tpot_s)
            p = t.placement
            here = p.first_engine is not None and p.first_engine == t.decode_engine
            prefill.append(per_token_s * p.prefill_tokens + per_request_s if here else 0.0)
    beyond = len(running) + len(queued) + external + 1 - slots
    if beyond <= 0:
        return ()
    holding = min(external, max(0, slots - len(running)))  # the engine runs at most ``slots``
    running.extend([more_s] * holding)
    waiting = external - holding  # at the engine already: in line before the router's next
    queued[:0] = [more_s] * waiting
    prefill[:0] = [0.0] * waiting
    return tuple(now + r for r in slot_releases(running, queued, slots, more_s, min(RELEASES_MAX, beyond + 8), prefill))
