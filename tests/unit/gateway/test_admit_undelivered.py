"""An admission call that never reached the scheduler gives back what it carried (found by a
read-only review of the admission bookkeeping; failed before its fix): the spare permits handed
back with it were gone from the lease while the scheduler still held them reserved for it, so it
was never topped up again and could not admit locally until its record changed.  The scheduler
answers every call it gets (a fault in it is a counted refusal), so a call that raised is one it
never had."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.admission.view import Ask
from narwhal_serve.gateway.admit import Refused, admit
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.scheduler.messages import AdmitRequest
from tests.support.scheduler import scheduler_service


async def test_an_admit_call_that_failed_gives_its_spare_permits_back() -> None:
    svc, clock = scheduler_service({"mode": "open"})

    async def send(rep: Any) -> Any:
        return svc.report(rep)

    lease = AdmissionLease("L")
    r = Reporter(send, lease=lease, linger_s=0, renew_s=0.05, clock=clock)
    r.start()
    try:
        await r.flush()
        full = lease.spare
        assert full.any()
        lease.valid_until = 0.0  # (a renewal late: the lease defers to the scheduler)

        async def unreachable(req: AdmitRequest) -> Any:
            raise ConnectionError("scheduler unreachable")

        got = await admit(r, "req-1/ab", Ask(10, 30.0), clock.t + 60, clock.t, time.monotonic(), unreachable)
        assert isinstance(got, Refused)
        for _ in range(3):
            await r.flush()
        assert lease.spare == full, (lease.spare, full)
        assert lease.try_admit("req-2/cd", Ask(10, 30.0), clock.t + 60, clock.t, time.monotonic()) is not None
    finally:
        await r.stop()


async def test_a_fault_in_the_schedulers_admission_is_a_counted_refusal(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    svc, clock = scheduler_service({"mode": "open"})

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(svc, "decision_view", broken)
    req = AdmitRequest.of("req-3/ef", clock.t + 60, Ask(10, 30.0))
    with caplog.at_level(logging.ERROR):
        res = await svc.admit(req)
    assert res.error is not None and res.error.code == "internal_error" and res.error.status == 500
    assert svc.calls["admit_failed"] == 1 and "failed in the scheduler" in caplog.text
    assert svc.counters.contract_view()["failed"] == 1
