"""An ingress replica's admission of one sized request: under its lease when the lease can decide
(no scheduler call), else by the scheduler's admit call (which may queue it).  The gateway's
request handler and the trace replay (``narwhal_serve/replay``) both admit through here, so a
replayed request is judged exactly as a served one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from narwhal_serve.admission.controller import NONE, Refusal
from narwhal_serve.admission.core import Ask
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.errors import ErrorInfo
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.gateway.streaming import internal_error
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult
from narwhal_serve.tenants.amounts import Amounts


@dataclass(frozen=True)
class Admitted:
    routes: tuple[RouteChoice, ...]
    predicted_s: float | None
    epoch: int  # the router lease's fencing token it was admitted under
    by: str  # "lease" or "scheduler"
    remaining: Amounts | None  # its tenant's remaining budget (rate-limit headers), when budgeted


@dataclass(frozen=True)
class Refused:
    outcome: Outcome
    error: ErrorInfo
    counted: bool  # the scheduler counted it already


def undelivered(lease: AdmissionLease, req: AdmitRequest) -> None:
    """An admission call that never reached the scheduler (it raised: the scheduler answers every
    call it gets): what it carried of the lease's goes with a report instead — its spare permits
    (else held for this lease at the scheduler for good, never topped up again) and its tenant's
    share."""
    lease.undelivered(req.returned, req.lease_epoch)
    if lease.shares is not None:
        lease.shares.give_again(req.ticket_id, req.tenant, req.tenant_returned)


async def admit(reporter: Reporter, ticket: str, ask: Ask, deadline: float, now: float, mono: float,
                call: Callable[[AdmitRequest], Awaitable[AdmitResult]], *, slots_counted: bool = False
                ) -> Admitted | Refused:
    """``call``: the scheduler's admit (the gateway wraps it so a client that leaves withdraws it).
    ``slots_counted``: the request's tenant has a ``max_concurrent`` (its slots counted at the
    scheduler), with or without admission leases."""
    lease = reporter.lease
    if lease is not None:
        verdict = lease.try_admit(ticket, ask, deadline, now, mono)
        if isinstance(verdict, Refusal):
            return Refused(verdict.outcome, verdict.error, False)
        if verdict is not None:
            remaining = lease.shares.remaining(ask.tenant, now) if lease.shares is not None else None
            return Admitted(verdict.routes, verdict.predicted_s, lease.view.epoch if lease.view is not None else 0,
                            "lease", remaining)
    if slots_counted and reporter.ends_unheard():
        # the tenant's slots are counted at the scheduler: it hears first what ended here (a client
        # sending its next request as the last one ends is judged on its count of one, not two) —
        # without leases too (only a lease's shares said so: a sequential client was refused 429)
        await reporter.flush()
    admit_req = AdmitRequest.of(
        ticket, deadline, ask,
        lease_id=lease.lease_id if lease is not None else None,
        returned=lease.give_back_spare() if lease is not None else NONE,
        tenant_returned=lease.shares.give_back(ask.tenant) if lease is not None and lease.shares is not None else Amounts(),
        lease_epoch=lease.epoch if lease is not None else 0,
    )
    try:
        result = await call(admit_req)
    except Exception as exc:  # the scheduler could not be reached
        if lease is not None:
            undelivered(lease, admit_req)
        return Refused(Outcome.FAILED, internal_error(f"admission failed: {type(exc).__name__}"), False)
    if result.error is not None:  # the scheduler counted it
        return Refused(result.outcome or Outcome.REJECTED, result.error, True)
    return Admitted(result.candidates, result.predicted_ttft_s, result.epoch, "scheduler", result.remaining)
