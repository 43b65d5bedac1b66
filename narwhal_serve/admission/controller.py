"""The seed's admission table as one pure state machine.

Every method takes ``now`` and does no I/O; the scheduler deployment wraps it with futures.

Permits: a request holds one **retention** slot from arrival at admission until it ends (waiting or
in flight), one **prefill** permit from admission until its first token, and one **decode**
reservation from admission until it ends, so entering decode never blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from narwhal_serve.admission.outcomes import Outcome
from narwhal_serve.config import AdmissionConfig, ServingConfig
from narwhal_serve.errors import ErrorInfo, RateLimited, TerminalExpiry

Phase = Literal["queued", "prefill", "decode"]


@dataclass
class Ticket:
    id: str
    arrived: float
    deadline: float  # min(request deadline, arrival + max_wait) bounds the wait
    request_deadline: float
    phase: Phase = "queued"


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
        self.prefill = 0
        self.decode = 0

    # -- capacity ---------------------------------------------------------------------------
    def _permit_free(self) -> bool:
        pc = self.cfg.phase_concurrency
        return self.prefill < pc.prefill and self.decode < pc.decode

    def _grant(self, t: Ticket) -> None:
        t.phase = "prefill"
        self.prefill += 1
        self.decode += 1

    def offer(self, ticket_id: str, now: float, request_deadline: float) -> Decision:
        """A request asks for admission (after router-state, eligibility and predictive checks)."""
        if ticket_id in self.retained:
            raise ValueError(f"duplicate ticket {ticket_id}")
        if len(self.retained) >= self.retention_limit:
            return retention_full()
        t = Ticket(ticket_id, now, min(request_deadline, now + self.cfg.max_wait_s), request_deadline)
        if not self.queue and self._permit_free():
            self.retained[ticket_id] = t
            self._grant(t)
            return Grant(t)
        if len(self.queue) >= self.cfg.queue_limit:
            return queue_full()
        self.retained[ticket_id] = t
        self.queue[ticket_id] = t
        return Enqueued(t)

    def pump(self, now: float) -> tuple[list[Ticket], list[tuple[Ticket, Refusal]]]:
        """Grant queued tickets while permits are free (FIFO); expire the ones past their wait."""
        granted: list[Ticket] = []
        expired = self.expire_due(now)
        while self.queue and self._permit_free():
            _, t = self.queue.popitem(last=False)
            self._grant(t)
            granted.append(t)
        return granted, expired

    def expire_due(self, now: float) -> list[tuple[Ticket, Refusal]]:
        out = []
        for tid in [tid for tid, t in self.queue.items() if now >= t.deadline]:
            t = self.queue.pop(tid)
            self.retained.pop(tid, None)
            out.append((t, wait_expired(t, now)))
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
            self.queue.pop(ticket_id, None)
        else:
            if t.phase == "prefill":
                self.prefill -= 1
            self.decode -= 1
        return True

    def gauges(self) -> dict[str, int]:
        return {
            "retained": len(self.retained),
            "queued": len(self.queue),
            "prefill_inflight": self.prefill,
            "decode_inflight": self.decode,
        }
