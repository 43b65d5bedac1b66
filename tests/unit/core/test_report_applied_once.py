"""A report the scheduler applies part-way and then fails on is not applied again (found by a
read-only review of the admission bookkeeping; failed before its fix): the exception reached the
ingress, which sent the same report again whole — counters merged twice, and a lease's placement
charged twice but released once, the engine's in-flight count off for good."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.admission.view import Ask
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.protocol.outcomes import Outcome
from tests.support.scheduler import scheduler_service


async def test_a_report_that_fails_part_way_is_applied_once(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    svc, clock = scheduler_service({"mode": "open"})
    lease = AdmissionLease("L")

    async def send(rep: Any) -> Any:  # (the ingress's call over Ray, in-process)
        return svc.report(rep)

    r = Reporter(send, lease=lease, linger_s=0, renew_s=0.05, clock=clock)
    r.start()
    try:
        await r.flush()
        assert lease.view is not None
        r.offered()
        v = lease.try_admit("req-1/ab", Ask(10, 30.0), clock.t + 60, clock.t, time.monotonic())
        assert v is not None and not hasattr(v, "error"), v
        real = svc._local_placed
        failed: list[Any] = []

        def breaks_once(*args: Any, **kwargs: Any) -> Any:  # a fault after the counters are in
            out = real(*args, **kwargs)
            if not failed:
                failed.append(args)
                raise RuntimeError("a bug in the report's handling")
            return out

        monkeypatch.setattr(svc, "_local_placed", breaks_once)
        with caplog.at_level(logging.ERROR):
            await r.flush()
            await asyncio.sleep(0.2)  # (a failed report was sent again at once, whole)
        assert failed
        r.ended("req-1/ab", Outcome.COMPLETED, "", None)
        await r.flush()
        await r.flush()
    finally:
        await r.stop()
    c = svc.counters.contract_view()
    assert (c["offered"], c["completed"]) == (1, 1), c
    assert all(e.inflight == 0 for e in svc.engines.values()), {n: e.inflight for n, e in svc.engines.items()}
    assert not svc._tickets
    assert svc.calls["report_failed"] == 1 and "failed part-way" in caplog.text
