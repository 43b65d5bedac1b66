"""An ingress replica's admission lease: admit, refuse and place locally, with no scheduler call.

The scheduler reserves permits for the lease (:class:`~narwhal_serve.admission.controller.Permits`)
and sends, with each answer to a report, a :class:`~narwhal_serve.admission.core.FleetView`.  The
lease decides with the same pure :func:`~narwhal_serve.admission.core.decide` the scheduler runs,
on that view plus its own placements since ("the others as last known, plus mine exactly").

Accounting is additive, so it stays exact however messages interleave: the scheduler adds to a
reservation before it sends a grant; the lease gives permits back only from its spare, and only
in a report or an admission call.  What the scheduler counts as reserved is therefore never less
than what the lease holds, and leases never sum past a global limit.

Defers to the scheduler (``None``) when the lease has expired (no answer within ``ttl_s`` of the
report that renewed it), when a permit is missing, when the scheduler's queue is not empty —
queued requests go first, and the queue keeps queue-full, waits and 504s exact — and when the
view says the router or the whole fleet is unavailable: that view is up to one renewal old, and a
503 the scheduler would no longer give (an engine back, a standby promoted) must not go out.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from narwhal_serve.admission import ledger
from narwhal_serve.admission.controller import NONE, ONE_REQUEST, Permits, Refusal
from narwhal_serve.admission.core import Ask, EngineDelta, EngineFacts, FleetView, Placement, decide
from narwhal_serve.admission.facts import copied
from narwhal_serve.admission.ledger import Ticket, add
from narwhal_serve.admission.retry import Reservation, earliest
from narwhal_serve.admission.wire import LeaseGrant, LeasePart, LocalPlacement
from narwhal_serve.config import EngineConfig
from narwhal_serve.placement.picker import resume_targets
from narwhal_serve.tenants.amounts import request_cost
from narwhal_serve.tenants.rules import budget_error
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.tenants.shares import LeaseShares


# Refusals that only restate the scheduler's state; the scheduler gives them, from the state as it is.
_STATE_REFUSALS = frozenset({"backend_unavailable", "router_unavailable"})


@dataclass
class _Sent:
    part: LeasePart
    deltas: dict[str, EngineDelta]


@dataclass
class AdmissionLease:
    lease_id: str
    spare: Permits = NONE
    in_use: Permits = NONE
    spare_target: Permits = NONE
    view: FleetView | None = None
    valid_until: float = 0.0  # monotonic
    rotation: int = 0
    generation: int = 0
    view_seq: int = 0  # the scheduler's number of the view held (LeaseGrant.view_seq)
    epoch: int = 0  # the scheduler's record this lease's permits are reserved under (0: none yet)
    tickets: dict[str, Ticket] = field(default_factory=dict)  # its own admissions (ledger.py)
    _deltas: dict[str, EngineDelta] = field(default_factory=dict)  # since the last cut
    _total: dict[str, EngineDelta] = field(default_factory=dict)  # since the view (sent, unanswered, and since the cut)
    _changed: dict[str, EngineFacts] = field(default_factory=dict)  # the view's engines with _total in
    _placed: list[LocalPlacement] = field(default_factory=list)
    _to_return: Permits = NONE
    _sent: dict[int, _Sent] = field(default_factory=dict)
    _reserved: list[Reservation] = field(default_factory=list)  # since the last cut
    _consumed: list[str] = field(default_factory=list)  # since the last cut
    shares: LeaseShares | None = None  # tenants' budgets (tenants/); None: no budgets

    def __post_init__(self) -> None:
        # each lease turns ties from its own place (leases deciding on the same view in the same
        # instant would otherwise all put their next request on the same idle engine)
        self.rotation = self.rotation or zlib.crc32(self.lease_id.encode())

    # -- admission ----------------------------------------------------------------------------
    def valid(self, mono: float) -> bool:
        return self.view is not None and mono < self.valid_until

    def current_view(self) -> FleetView | None:
        if self.view is None:
            return None
        view = copied(self.view, changed=dict(self._changed)) if self._changed else self.view  # (its derived data shared)
        mine = [r for s in self._sent.values() for r in s.part.reserved] + self._reserved
        taken = {i for s in self._sent.values() for i in s.part.consumed} | set(self._consumed)
        if mine or taken:
            known = {r.id for r in view.reservations}
            held = tuple(r for r in view.reservations if r.id not in taken) + tuple(
                r for r in mine if r.id not in known and r.id not in taken)
            view = copied(view, reservations=held)
        return view

    def resume_targets(self, now: float, tokens: int = 0) -> list[EngineConfig]:
        """Engines eligible now for a mid-stream resume whose context leaves a continuation of
        ``tokens`` (the prompt and the output so far) room for more, least loaded first (none
        without a view)."""
        view = self.current_view()
        return [] if view is None else resume_targets([e for e in view.eligible(now) if e.holds(tokens)])

    def context_of(self, engine: str) -> int | None:
        """An engine's context (``max_model_len``) as the view says it (None: not said, or no view)."""
        view = self.current_view()
        facts = view.facts().get(engine) if view is not None else None
        return facts.context or None if facts is not None else None

    def try_admit(self, ticket_id: str, ask: Ask, deadline: float, now: float, mono: float) -> Placement | Refusal | None:
        """A placement (permits taken), a refusal (counted by the caller), or None: ask the scheduler."""
        view = self.current_view()
        if view is None or not self.valid(mono) or view.queued:
            return None
        cost = request_cost(ask.prompt_tokens)
        if self.shares is not None:
            budget = self.shares.check(ask.tenant, cost, now, retry=ask.retry, reserves=ask.reserves)
            if budget is False:
                return None
            if budget is not True:
                return Refusal(budget_error(budget), Outcome.REJECTED)
        self.rotation += 1
        verdict = decide(view, ask, now, self.rotation)
        if isinstance(verdict, Refusal):
            if verdict.reason in _STATE_REFUSALS:
                return None
            if verdict.reserve is not None:
                kept = replace(verdict.reserve, id=ticket_id)
                self._reserved.append(kept)
                verdict = replace(verdict, reserve=kept)
            return verdict
        if not self.spare.covers(ONE_REQUEST):
            return None
        self.spare = self.spare - ONE_REQUEST
        self.in_use = self.in_use + ONE_REQUEST
        if self.shares is not None:
            self.shares.take(ticket_id, ask.tenant, cost)
        t = self.tickets[ticket_id] = Ticket(verdict)
        self._note(ledger.admitted(t))
        self._placed.append(LocalPlacement(ticket_id, verdict, deadline))
        if ask.retry and (r := earliest(view.reservations, now)) is not None:
            self._consumed.append(r.id)  # the retry takes the room kept for it
        return verdict

    def _note(self, deltas: dict[str, EngineDelta]) -> None:
        """Own changes to the fleet's counts: into the next report, and into the view's engines."""
        add(self._deltas, deltas)
        add(self._total, deltas)
        self._refresh(deltas)

    def _refresh(self, names: Iterable[str]) -> None:
        facts = self.view.facts() if self.view is not None else {}
        for name in names:
            e, d = facts.get(name), self._total.get(name)
            if e is None or d is None or d.nothing():
                self._changed.pop(name, None)
            else:
                self._changed[name] = e.plus(d)

    def give_back_spare(self) -> Permits:
        """All spare permits, handed back with an admission call to the scheduler (a deficit
        stays: nothing to give)."""
        out = self.spare.positive()
        self.spare = self.spare - out
        return out

    def undelivered(self, returned: Permits, epoch: int) -> None:
        """Spare permits handed back with an admission call that never reached the scheduler (it
        answers every call it gets, faults included): they go back with the next report, under the
        record they were reserved in (another record's are void there)."""
        if epoch == self.epoch and returned.any():
            self._to_return = self._to_return + returned

    # -- lifecycle of a locally admitted request ----------------------------------------------
    def first_token(self, ticket_id: str, engines: tuple[str, ...]) -> None:
        """The first token came from ``engines`` (again later: a resume moved the answer there)."""
        t = self.tickets.get(ticket_id)
        if t is None:
            return
        was_done = t.prefill_done
        self._note(ledger.first_token(t, engines))
        if not was_done:
            self._free(Permits(prefill=1))

    def progress(self, ticket_id: str, tokens: int) -> None:
        """Decode correction for a local ticket: its remaining decode from the tokens it generated."""
        t = self.tickets.get(ticket_id)
        if t is not None:
            self._note(ledger.progressed(t, tokens))
            if self.shares is not None:
                self.shares.progress(ticket_id, tokens)

    def release(self, ticket_id: str, output_tokens: int | None = None) -> None:
        """``output_tokens``: the stream's identified output tokens, charged to its tenant."""
        t = self.tickets.pop(ticket_id, None)
        if t is None:
            return
        if self.shares is not None:
            self.shares.release(ticket_id, output_tokens)
        freed = Permits(retention=1, decode=1) + (NONE if t.prefill_done else Permits(prefill=1))
        self._note(ledger.released(t))
        self._free(freed)

    def _free(self, p: Permits) -> None:
        self.in_use = self.in_use - p
        self.spare = self.spare + p
        self._trim()

    def _trim(self) -> None:
        """Spare beyond the target goes back with the next report."""
        extra = (self.spare - self.spare_target).clamp(NONE, self.spare)
        if extra.any():
            self.spare = self.spare - extra
            self._to_return = self._to_return + extra

    # -- the exchange with the scheduler ------------------------------------------------------
    def cut(self, mono: float) -> LeasePart:
        """This lease's share of the next report (kept until answered or restored)."""
        if not self.valid(mono) and self.spare.positive().any():  # an expired lease holds nothing spare
            back = self.spare.positive()
            self._to_return = self._to_return + back
            self.spare = self.spare - back
        self.generation += 1
        part = LeasePart(self.lease_id, self.generation, self.epoch, self._placed, self._to_return, self.in_use,
                         self._reserved, self._consumed,
                         self.shares.cut(self.generation) if self.shares is not None else None, self.view_seq)
        self._sent[self.generation] = _Sent(part, self._deltas)
        self._placed, self._to_return, self._deltas = [], NONE, {}
        self._reserved, self._consumed = [], []
        return part

    def restore(self, generation: int) -> None:
        """The report carrying ``generation`` failed: its events go out again with the next one."""
        s = self._sent.pop(generation, None)
        if s is None:
            return
        if self.shares is not None:
            self.shares.restore(generation)
        self._placed = s.part.placed + self._placed
        self._to_return = self._to_return + s.part.returned
        self._reserved = s.part.reserved + self._reserved
        self._consumed = s.part.consumed + self._consumed
        merged = dict(s.deltas)
        add(merged, self._deltas)
        self._deltas = merged

    def apply(self, grant: LeaseGrant, now: float, cut_mono: float) -> None:
        """The scheduler answered the report of ``grant.generation``, cut at ``cut_mono``."""
        answered = self._sent.get(grant.generation)
        for g in [g for g in self._sent if g <= grant.generation]:
            del self._sent[g]
        if self.shares is not None:
            self.shares.apply(grant.generation, grant.tenant_granted, grant.tenant_targets, grant.tenant_facts,
                              new_record=grant.epoch != self.epoch, dt=now - grant.sched_now)
        if grant.epoch != self.epoch:
            # A new record reserved exactly what that report had in use (plus ``granted``): what
            # this lease holds now must add up to it. Permits freed since the cut stay (they are in
            # that count); admissions since the cut, made on void spare, become a deficit that
            # blocks local admission until frees repay it (spare may go negative).
            self.epoch = grant.epoch
            in_use_then = answered.part.in_use if answered is not None else self.in_use
            self.spare = in_use_then - self.in_use - self._to_return
        view: FleetView | None = grant.view
        if grant.view_base:  # changes since the view it names (the scheduler sends it only if it is ours)
            view = self.view.merged(grant.view, grant.names, grant.prefixes, grant.rows) if self.view is not None and \
                self.view_seq == grant.view_base else None
        if view is None:  # not ours: keep the view, and say we have none (the next grant is whole)
            self.view_seq = 0
            view = None if self.view is None else self.view.shifted(-self.view.shift)  # (in the scheduler's clock)
        else:
            self.view_seq = grant.view_seq
        self.view = None if view is None else view.shifted(now - grant.sched_now)
        self._total = {}
        for sent in self._sent.values():
            add(self._total, sent.deltas)
        add(self._total, self._deltas)
        self._changed = {}
        self._refresh(self._total)
        self.valid_until = cut_mono + grant.ttl_s
        self.spare = self.spare + grant.granted
        self.spare_target = grant.spare_target
        self._trim()
