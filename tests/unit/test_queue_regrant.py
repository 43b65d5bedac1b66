"""A queued request is decided again when granted (9bd0b02): what a refusal there frees goes to the
next in line at once.  Found by a review of that change; the test failed before its fix."""

import asyncio

from narwhal_serve.scheduler.messages import AdmitRequest, Report
from tests.support.scheduler import scheduler_service


async def test_a_permit_freed_by_a_refusal_at_grant_goes_to_the_next_in_the_queue() -> None:
    """b is granted from the queue, decided again and refused (it waited out its budget): its
    permit is released. c, queued behind it and still within its budget, must get that permit
    now, not sit in the queue with a permit free until some other event pumps the queue (another
    release, or its own max_wait expiry: admission_wait_expired)."""
    svc, clock = scheduler_service(
        {"mode": "predictive", "queue_limit": 4, "max_wait_s": 5, "phase_concurrency": {"prefill": 1, "decode": 4}})
    a = await svc.admit(AdmitRequest("a", 2000.0, 10, 16, 2.0))
    assert a.error is None
    late = asyncio.ensure_future(svc.admit(AdmitRequest("b", 2000.0, 10, 16, 2.0, waited_s=1.9)))
    on_time = asyncio.ensure_future(svc.admit(AdmitRequest("c", 2000.0, 10, 16, 2.0)))
    await asyncio.sleep(0)
    assert svc.admission.gauges()["queued"] == 2
    for e in svc.engines.values():
        e.last_ok = clock.t + 0.5
    clock.t += 0.5  # b: 2.4 s of its 2 s gone; c: 0.5 s
    svc.report(Report(decode_started=[("a", ())]))  # a's prefill permit frees: b is granted, and refused
    b = await late
    assert b.error is not None and b.error.code == "ttft_budget_exceeded", b
    for _ in range(3):
        await asyncio.sleep(0)
    # the prefill permit b gave back is free, and c waits for one
    assert on_time.done(), (svc.admission.gauges(), svc.admission.free())
    c = on_time.result()
    assert c.error is None, c.error
    assert svc.admission.gauges()["queued"] == 0
