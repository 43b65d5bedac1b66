"""Promises: the room kept for refused clients that retry (docs/contract.md, "Tenants", "Retry-After a
client can trust").  A refusal says when the bucket will hold the request *after every request
promised before it*; a client that says it retries (``X-Stainless-Retry-Count``) is promised that
room until ``PROMISE_GRACE_S`` after its Retry-After.  Kept per tenant by the scheduler (:mod:`.book`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from narwhal_serve.tenants.amounts import NOTHING, Amounts

PROMISE_GRACE_S = 2.0  # a promise whose client has not come back this long after its Retry-After lapses
PROMISE_HORIZON_S = 3600.0  # no promise is made further ahead than this (its Retry-After is still honest)
MAX_PROMISES = 100_000  # per tenant (about 10 MB at most)
EARLY_S = 0.05  # a promised retry this much early is told the rest of its wait


@dataclass
class Promise:
    id: str  # the refused request's fingerprint
    due: float
    until: float
    cost: Amounts
    gone: bool = False


@dataclass
class Promises:
    """A tenant's promises in the order they were made, which is the order they fall due (each is
    made behind all the others).  Sums are kept, so a decision costs no walk over the queue."""

    queue: deque[Promise] = field(default_factory=deque)
    by_id: dict[str, Promise] = field(default_factory=dict)
    total: Amounts = NOTHING

    def __len__(self) -> int:
        return len(self.by_id)

    def expire(self, now: float) -> None:
        while self.queue and (self.queue[0].gone or self.queue[0].until < now):
            p = self.queue.popleft()
            if not p.gone:
                self.take(p)

    def take(self, p: Promise) -> None:
        """``p`` is used (or lapsed): its room is no longer kept (it leaves the deque lazily)."""
        p.gone = True
        self.by_id.pop(p.id, None)
        self.total = self.total - p.cost

    def ahead_of(self, mine: Promise | None, now: float) -> Amounts:
        """What is promised before ``mine`` and not yet due (all of it, for a request without a
        promise).  By the time a promise falls due the bucket holds it and every one before it, so
        an earlier one whose client is late (or never comes) does not hold up a client on time."""
        if mine is None:
            return self.total
        out = NOTHING
        for p in self.queue:  # (those before it still live: the few within their grace, or due)
            if p is mine:
                break
            if not p.gone and p.due > now:
                out = out + p.cost
        return out

    def add(self, p: Promise) -> None:
        self.queue.append(p)
        self.by_id[p.id] = p
        self.total = self.total + p.cost

    def put_back(self, p: Promise) -> None:
        """A promise taken by a request that was then refused for another reason."""
        if not p.gone or p.id in self.by_id:
            return
        p.gone = False
        if not any(q is p for q in self.queue):  # (taken, it leaves the deque lazily: it may be there still)
            i = next((k for k, q in enumerate(self.queue) if q.due > p.due), len(self.queue))
            self.queue.insert(i, p)
        self.by_id[p.id] = p
        self.total = self.total + p.cost
