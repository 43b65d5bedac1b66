"""The scheduler's tickets: each admitted request's charges on the engines (the ledger's,
``admission/ledger.py``, applied to the engines' live counts), its tenant's budget, and what its end
teaches the models."""

from __future__ import annotations

from collections.abc import Callable

from narwhal_serve.admission import ledger
from narwhal_serve.admission.core import Placement
from narwhal_serve.admission.wire import LocalPlacement
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.scheduler.messages import AdmitResult
from narwhal_serve.scheduler.state import SchedulerState
from narwhal_serve.scheduler.state import SchedulerTicket


def _full(e: EngineState) -> bool:
    """Every slot of ``e`` is decoding (the router's requests past their prefill and others'):
    the head of its line waits for one."""
    slots = e.slots()
    return slots is not None and slots > 0 and e.in_flight() - e.pending_prefill_requests >= slots


class TicketBook(SchedulerState):
    """Admitted requests: charged, corrected as they run, released."""

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
        t = self._tickets[tid] = SchedulerTicket(placement, deadline=deadline, lease=lease)
        self._ticket_event(tid, t, ledger.admitted)

    def _ticket_event(self, tid: str, t: SchedulerTicket, event: Callable[[SchedulerTicket], ledger.Deltas]) -> None:
        """A ledger event of ``t`` (one that may move its decode charge) applied to the engines, and
        ``t``'s place in the index by decode engine kept (its engine now; none once released)."""
        was = t.decode_engine
        # the engines where the head of the line waits for a slot: every slot decoding
        full = [n for n in t.engines if (e := self.engines.get(n)) is not None and e.prefill_line and _full(e)]
        self._apply(event(t))
        self._line(tid, t, full)
        now = t.decode_engine if tid in self._tickets else None
        if now == was:
            return
        if was is not None and (on := self._decoding.get(was)) is not None:
            on.pop(tid, None)
            if not on:
                del self._decoding[was]
        if now is not None:
            self._decoding.setdefault(now, {})[tid] = t

    def _line(self, tid: str, t: SchedulerTicket, full: list[str]) -> None:
        """``t``'s place in its first-token engine's line of pending prefills kept (in it until its
        prefill is done).  The head of a line starts its prefill when it becomes the head, or when
        a slot frees there if every slot was decoding (``full``: such engines ``t`` was charged to
        before the event; one with a slot not decoding now freed it for the head — a request in
        line leaving frees none).  Its prefill never counts from before it had a slot."""
        e = self.engines.get(t.placement.first_engine or "")
        if e is not None:
            line = e.prefill_line
            head = next(iter(line), None)
            if tid in self._tickets and not t.prefill_done:
                line.setdefault(tid, t.placement.prefill_tokens)
            else:
                line.pop(tid, None)
            new_head = next(iter(line), None)
            if new_head != head:  # a new head: it prefills from now if it has a slot (else from when one frees)
                e.line_since = None if new_head is None or _full(e) else self.clock()
        for name in full:
            e = self.engines.get(name)
            if e is not None and e.prefill_line and not _full(e):
                e.line_since = self.clock()

    def _apply(self, deltas: ledger.Deltas) -> None:
        """The ledger's changes applied to the engines' live counts (an engine gone: skipped)."""
        for name, d in deltas.items():
            e = self.engines.get(name)
            if e is None:
                continue
            self.touch(name)
            e.inflight += d.inflight
            e.pending_prefill_tokens = max(0, e.pending_prefill_tokens + d.pending_prefill_tokens)
            e.pending_prefill_requests = max(0, e.pending_prefill_requests + d.pending_prefill_requests)
            e.decode_tokens = max(0.0, e.decode_tokens + d.decode_tokens)
            if d.prefix:
                e.prefix.pend(d.prefix)  # a pending prefix (admission/ledger.py charge)
            if d.prefix_done and not self.kv_events.unpend(e, d.prefix_done):
                e.prefix.unpend(d.prefix_done)

    def _progress(self, tid: str, tokens: int) -> None:
        """Decode correction: the ticket's remaining decode from the tokens it generated so far."""
        t = self._tickets.get(tid)
        if t is not None:
            self._apply(ledger.progressed(t, tokens, self.clock()))
            if t.lease is None and tokens > t.output_charged:  # (a lease charges its own tickets' outputs)
                self.tenants.charge_output(t.placement.tenant, tokens - t.output_charged, self.clock())
                t.output_charged = tokens

    def _placed(self, tid: str, placement: Placement, deadline: float, asker: str | None) -> AdmitResult:
        """``asker``: the lease of the ingress that asked (None: none), which has the answer."""
        self._budgeted.pop(tid, None)  # its ticket holds the budget now (released with it)
        self._charge(tid, placement, deadline, None)
        self.placement_watch.placed(asker)  # the other leases hear of it
        st = self.tenants.states.get(placement.tenant)
        return AdmitResult(candidates=placement.routes, predicted_ttft_s=placement.predicted_s, epoch=self.ha.epoch(),
                           remaining=st.remaining() if st is not None else None)

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
        self._ticket_event(tid, t, ledger.released)
        if stats is not None and not stats.partial:  # (a cut stream's stats are counted, not learned from)
            learn_from(stats, t.placement, self.engines, self.histograms, self.tally, completed, self.outputs,
                       self.clock(), self.cfg.placement, self._fleet_prior)
            for name in t.placement.engines:  # its models, margins, drift, prefix credit
                self.touch(name)
        self.tenant_tally.ended(t.placement.tenant, t.placement, stats, completed)
        if self.tenants.specs:
            p = t.placement
            out = stats.output_tokens if stats is not None else t.output_charged
            duration = stats.ttft_s + stats.decode_s if stats is not None and stats.ttft_s is not None else None
            self.tenants.ended(p.tenant, self.clock(), output_tokens=max(0.0, out - t.output_charged) if t.lease is None else 0.0,
                               duration_s=duration, own=t.lease is None)
