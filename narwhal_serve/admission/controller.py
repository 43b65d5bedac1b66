"""The contract's admission table as one pure state machine.

Every method takes ``now`` and does no I/O; the scheduler deployment wraps it with futures.

Permits: a request holds one **retention** slot from arrival at admission until it ends (waiting or
in flight), one **prefill** permit from admission until its first token, and one **decode**
reservation from admission until it ends, so entering decode never blocks.

Leases: ingress replicas admit locally against permits *reserved* here for them
(:meth:`AdmissionController.reserve`); a reservation counts as used, so the sum of everything
reserved and held never passes a global limit.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Literal

from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.admission.retry import Reservation
from narwhal_serve.config import AdmissionConfig, ServingConfig
from narwhal_serve.errors import ErrorInfo, RateLimited, TerminalExpiry

Phase = Literal["queued", "prefill", "decode"]


@dataclass(frozen=True)
class Permits:
    """A count of each permit kind (what a lease reserves, holds or gives back)."""

    retention: int = 0
    prefill: int = 0
    decode: int = 0

    def __add__(self, o: "Permits") -> "Permits":
        return Permits(self.retention + o.retention, self.prefill + o.prefill, self.decode + o.decode)

    def __sub__(self, o: "Permits") -> "Permits":
        return Permits(self.retention - o.retention, self.prefill - o.prefill, self.decode - o.decode)

    def clamp(self, lo: "Permits", hi: "Permits") -> "Permits":
        return Permits(
            max(lo.retention, min(hi.retention, self.retention)),
            max(lo.prefill, min(hi.prefill, self.prefill)),
            max(lo.decode, min(hi.decode, self.decode)),
        )

    def positive(self) -> "Permits":
        return Permits(max(0, self.retention), max(0, self.prefill), max(0, self.decode))

    def covers(self, o: "Permits") -> bool:
        return self.retention >= o.retention and self.prefill >= o.prefill and self.decode >= o.decode

    def any(self) -> bool:
        return bool(self.retention or self.prefill or self.decode)


NONE = Permits()
ONE_REQUEST = Permits(1, 1, 1)  # what admitting one request takes


@dataclass
class Ticket:
    id: str
    arrived: float
    deadline: float  # min(request deadline, arrival + max_wait) bounds the wait
    request_deadline: float
    phase: Phase = "queued"
    rank: int = 0  # priority class (0: top): the queue grants the lowest rank first, FIFO within it
    tenant: str = ""  # within a class, tenants over their fair share wait behind the others


@dataclass(frozen=True)
class Grant:
    ticket: Ticket


@dataclass(frozen=True)
class Enqueued:
    ticket: Ticket


@dataclass(frozen=True)
class Refusal:
    error: ErrorInfo
    outcome: Outcome
    reserve: Reservation | None = None  # room to keep for this client's retry (admission/retry.py)

    @property
    def reason(self) -> str:
        return self.error.code


Decision = Grant | Enqueued | Refusal


def retention_full() -> Refusal:
    err = RateLimited(
        "The router's HTTP retention limit is full; retry after the Retry-After delay.",
        code="retention_full",
        retry_after=1,
    )
    return Refusal(err.info(), Outcome.REJECTED)


def queue_full() -> Refusal:
    err = RateLimited(
        "The admission queue is full; retry after the Retry-After delay.", code="queue_full", retry_after=1
    )
    return Refusal(err.info(), Outcome.REJECTED)


def wait_expired(ticket: Ticket, now: float) -> Refusal:
    if ticket.request_deadline <= ticket.deadline and now >= ticket.request_deadline:
        err = TerminalExpiry(
            "terminal expiry: the request deadline passed while waiting for admission", code="deadline_expired"
        )
    else:
        err = TerminalExpiry(
            "terminal expiry: the admission wait limit passed before a permit was free",
            code="admission_wait_expired",
        )
    return Refusal(err.info(), Outcome.EXPIRED)


class AdmissionController:
    def __init__(self, admission: AdmissionConfig, serving: ServingConfig) -> None:
        self.cfg = admission
        self.retention_limit = serving.http_retention_limit
        self.retained: dict[str, Ticket] = {}
        self.queue: OrderedDict[str, Ticket] = OrderedDict()
        self._ranks: Counter[int] = Counter()  # queued tickets per priority class
        self.prefill = 0
        self.decode = 0
        self.reserved = NONE  # held by leases (spare or in use)
        self.lease_in_use = NONE  # of which in use, as last reported (gauges)

    # -- capacity ---------------------------------------------------------------------------
    def limits(self) -> Permits:
        pc = self.cfg.phase_concurrency
        return Permits(self.retention_limit, pc.prefill, pc.decode)

    def free(self) -> Permits:
        """What is neither held here nor reserved by a lease."""
        return self.limits() - Permits(len(self.retained), self.prefill, self.decode) - self.reserved

    def reserve(self, want: Permits) -> Permits:
        """Reserve up to ``want`` for a lease; returns what was reserved (never past a limit)."""
        got = want.clamp(NONE, self.free())
        self.reserved = self.reserved + got
        return got

    def unreserve(self, back: Permits) -> None:
        self.reserved = (self.reserved - back).positive()  # may sit past a limit (reserve_in_use)

    def _permit_free(self) -> bool:
        f = self.free()
        return f.prefill > 0 and f.decode > 0

    def _grant(self, t: Ticket) -> None:
        t.phase = "prefill"
        self.prefill += 1
        self.decode += 1

    def offer(self, ticket_id: str, now: float, request_deadline: float, rank: int = 0, tenant: str = "") -> Decision:
        """A request asks for admission (after router-state, eligibility and predictive checks)."""
        if ticket_id in self.retained:
            raise ValueError(f"duplicate ticket {ticket_id}")
        if self.free().retention <= 0:
            return retention_full()
        t = Ticket(ticket_id, now, min(request_deadline, now + self.cfg.max_wait_s), request_deadline, rank=rank,
                   tenant=tenant)
        if not self.queue and self._permit_free():
            self.retained[ticket_id] = t
            self._grant(t)
            return Grant(t)
        if len(self.queue) >= self.cfg.queue_limit:
            return queue_full()
        self.retained[ticket_id] = t
        self.queue[ticket_id] = t
        self._ranks[rank] += 1
        return Enqueued(t)

    def pump(self, now: float, over_share: frozenset[str] = frozenset()
             ) -> tuple[list[Ticket], list[tuple[Ticket, Refusal]]]:
        """Grant queued tickets while permits are free (class order; within a class, tenants within
        their fair share before those over it, ``over_share``; then FIFO); expire the ones past
        their wait."""
        granted: list[Ticket] = []
        expired = self.expire_due(now)
        while self.queue and self._permit_free():
            t = self._next(over_share)
            self._unqueue(t.id)
            self._grant(t)
            granted.append(t)
        return granted, expired

    def _next(self, over_share: frozenset[str] = frozenset()) -> Ticket:
        first = next(iter(self.queue.values()))
        if len(self._ranks) <= 1 and not over_share:  # one class queued, shares met: FIFO
            return first
        top = min(self._ranks)
        best: Ticket | None = None
        for t in self.queue.values():  # (bounded by queue_limit)
            if t.rank == top:
                if t.tenant not in over_share:
                    return t
                best = best or t
        assert best is not None
        return best

    def _unqueue(self, tid: str) -> Ticket | None:
        t = self.queue.pop(tid, None)
        if t is not None:
            self._ranks[t.rank] -= 1
            if not self._ranks[t.rank]:
                del self._ranks[t.rank]
        return t

    def expire_due(self, now: float) -> list[tuple[Ticket, Refusal]]:
        out = []
        for tid in [tid for tid, t in self.queue.items() if now >= t.deadline]:
            t = self.queue[tid]
            self._unqueue(tid)
            self.retained.pop(tid, None)
            out.append((t, wait_expired(t, now)))
        return out

    def withdraw_queued(self) -> list[Ticket]:
        """Every queued ticket, taken out of the queue and released (the router stopped admitting:
        each is answered as a new request would be)."""
        out = list(self.queue.values())
        for t in out:
            self._unqueue(t.id)
            self.retained.pop(t.id, None)
        return out

    def next_expiry(self) -> float | None:
        return min((t.deadline for t in self.queue.values()), default=None)

    # -- lifecycle of an admitted request -----------------------------------------------------
    def enter_decode(self, ticket_id: str) -> None:
        t = self.retained.get(ticket_id)
        if t is not None and t.phase == "prefill":
            t.phase = "decode"
            self.prefill -= 1

    def release(self, ticket_id: str) -> bool:
        """The request ended (any way). Frees whatever it held; idempotent."""
        t = self.retained.pop(ticket_id, None)
        if t is None:
            return False
        if t.phase == "queued":
            self._unqueue(ticket_id)
        else:
            if t.phase == "prefill":
                self.prefill -= 1
            self.decode -= 1
        return True

    def gauges(self) -> dict[str, int]:
        return {
            "retained": len(self.retained) + self.lease_in_use.retention,
            "queued": len(self.queue),
            "prefill_inflight": self.prefill + self.lease_in_use.prefill,
            "decode_inflight": self.decode + self.lease_in_use.decode,
        }
