"""The scheduler's side of admission leases: who holds what, how much more to grant, and what to
reclaim from a lease that went silent (its ingress replica died)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from narwhal_serve.admission.controller import NONE, AdmissionController, Permits
from narwhal_serve.admission.facts import ChangedRow, PrefixChange
from narwhal_serve.admission.view import FleetView
from narwhal_serve.config import EngineConfig

LEASE_TTL_S = 2.0  # an ingress stops admitting locally this long after its last answered report
ORPHAN_S = 30.0  # a lease not heard from this long is forgotten: its spare permits come back
SPARE_CAP = 64  # most spare permits of one kind a lease holds

Held = tuple[EngineConfig, AbstractSet[int]]  # what a lease holds of an engine besides its facts' values
# a grant's view: the view, the prefix sets' changes and the rows of a delta (None and () for a whole one)
GrantView = tuple[FleetView, dict[str, PrefixChange] | None, tuple[ChangedRow, ...]]


@dataclass
class LeaseRecord:
    reserved: Permits = NONE  # spare + in use, as far as the scheduler knows (never less than held)
    in_use: Permits = NONE  # as last reported
    last_seen: float = 0.0
    tickets: set[str] = field(default_factory=set)
    epoch: int = 0
    view_seq: int = 0  # the last view granted (numbers unique to this scheduler)
    facts_seq: int = 0  # the scheduler's change number of the facts in it (GrantedFacts.since)
    held: dict[str, Held] = field(default_factory=dict)  # each engine's config and prefix set it holds
    members: int = -1  # the scheduler's membership count when it was granted


class LeaseLedger:
    def __init__(self, permits: AdmissionController) -> None:
        self.permits = permits
        self.leases: dict[str, LeaseRecord] = {}
        # epochs unique across scheduler replicas (a restarted scheduler must not reuse one)
        self._epochs = secrets.randbits(40) << 20
        self._views = secrets.randbits(40) << 20  # grant views' numbers, as unique

    def _sync_gauges(self) -> None:
        total = NONE
        for r in self.leases.values():
            total = total + r.in_use
        self.permits.lease_in_use = total

    def returned(self, lease_id: str | None, back: Permits, epoch: int) -> None:
        """Spare permits a lease gives back (in a report or an admission call); ignored when they
        were reserved under another record of the lease (they are void)."""
        rec = self.leases.get(lease_id or "")
        if rec is None or not back.any() or epoch != rec.epoch:
            return
        rec.reserved = rec.reserved - back
        self.permits.unreserve(back)

    def touch(self, lease_id: str, in_use: Permits, now: float) -> tuple[LeaseRecord, bool]:
        """The record of a reporting lease; ``True`` when it was unknown (new, or forgotten)."""
        rec = self.leases.get(lease_id)
        fresh = rec is None
        if rec is None:
            self._epochs += 1
            rec = LeaseRecord(epoch=self._epochs)
            self.leases[lease_id] = rec
            # what it has in use runs anyway: reserve it even past a limit
            self.permits.reserved = self.permits.reserved + in_use
            rec.reserved = in_use
        rec.in_use = in_use
        rec.last_seen = now
        self._sync_gauges()
        return rec, fresh

    def grant(self, rec: LeaseRecord, queue_waiting: bool) -> tuple[Permits, Permits]:
        """(granted, spare target): a fair share of what is free, nothing while requests queue."""
        if queue_waiting:
            return NONE, NONE
        live = max(1, len(self.leases))
        lim = self.permits.limits()

        def share(limit: int) -> int:
            return max(1, min(SPARE_CAP, limit // (2 * live)))

        target = Permits(share(lim.retention), share(lim.prefill), share(lim.decode))
        spare = (rec.reserved - rec.in_use).clamp(NONE, rec.reserved)
        got = self.permits.reserve((target - spare).clamp(NONE, target))
        rec.reserved = rec.reserved + got
        return got, target

    def view_for(self, rec: LeaseRecord, have: int, numbers: Callable[[], tuple[int, int]],
                 names: Callable[[], tuple[str, ...]],
                 view: Callable[[int | None, dict[str, Held]], GrantView],
                 ) -> tuple[GrantView, int, int, tuple[str, ...]]:
        """((view, prefix sets, rows), its number, base, names) for a grant: the engines changed
        since the view the lease has (``have``), when that is the last one granted it
        (``view(since, held)``: the engines changed after its change number, as rows, and the
        prefix sets it does not hold; ``names`` when the fleet's membership changed since); else
        the whole view (``view(None, held)``: a lost grant, a new record).  ``numbers``: the
        scheduler's change number and membership count, once the view is built."""
        self._views += 1
        base = rec.view_seq if have and have == rec.view_seq else 0
        out = view(rec.facts_seq if base else None, rec.held)
        facts_seq, members = numbers()
        changed_names = names() if base and members != rec.members else ()
        if changed_names:  # engines gone are gone from the lease's view: it holds nothing of theirs
            current = set(changed_names)
            for name in [n for n in rec.held if n not in current]:
                del rec.held[name]
        rec.view_seq, rec.facts_seq, rec.members = self._views, facts_seq, members
        return out, rec.view_seq, base, changed_names

    def orphans(self, now: float) -> list[tuple[str, LeaseRecord]]:
        """Leases silent for ORPHAN_S: forgotten, their permits unreserved; their tickets to reap."""
        out = [(k, r) for k, r in self.leases.items() if now - r.last_seen > ORPHAN_S]
        for k, r in out:
            del self.leases[k]
            self.permits.unreserve(r.reserved)
        if out:
            self._sync_gauges()
        return out
