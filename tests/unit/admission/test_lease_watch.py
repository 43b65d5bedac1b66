"""Placement news (scheduler/watch.py): a lease's parked watch call is answered when another
holder placed requests, and its ingress then reports at once, so that its view has those
placements before its next decision — not only with its next renewal."""

from __future__ import annotations

import asyncio
import random

import pytest

from narwhal_serve.admission.core import Ask, FleetView, Placement
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.admission.wire import LeasePart
from narwhal_serve.scheduler.leases import ORPHAN_S
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from narwhal_serve.scheduler.watch import PlacementWatch
from tests.support.scheduler import scheduler_service


def test_the_newest_placement_not_by_a_lease_is_known_for_every_lease_in_constant_memory() -> None:
    rng = random.Random(7)
    holders = ["a", "b", "c", None]
    for _ in range(200):
        w, log = PlacementWatch(), []
        for _ in range(rng.randint(0, 12)):
            h = rng.choice(holders)
            w.placed(h)
            log.append((w.seq, h))
            for lease in ("a", "b", "c", "d"):
                want = max((s for s, by in log if by != lease), default=0)
                assert w.newest_not_by(lease) == want


async def test_a_parked_watch_is_answered_by_another_holders_placement_not_by_its_own() -> None:
    w = PlacementWatch(quiet_s=0)
    call = asyncio.create_task(w.wait("a", timeout_s=30))
    await asyncio.sleep(0)
    w.placed("a")  # its own: no news
    await asyncio.sleep(0)
    assert not call.done()
    w.placed("b")
    assert await call is True
    assert await w.wait("a") is True  # news it has not heard (no report since): at once
    w.reported("a")  # its report's answer held it
    assert await w.wait("a", timeout_s=0.01) is False
    w.placed(None)  # a request no lease asked for: news for every lease
    assert await w.wait("a") is True
    assert await w.wait("b") is True  # (b never reported: every placement not its own is news)
    assert w.parked() == 0


async def test_a_lease_that_reported_a_moment_ago_hears_the_news_with_its_next_report_or_when_quiet() -> None:
    loop = asyncio.get_running_loop()
    w = PlacementWatch(quiet_s=0.05)
    w.reported("a")
    t0 = loop.time()
    call = asyncio.create_task(w.wait("a", timeout_s=30))
    await asyncio.sleep(0)
    w.placed("b")
    assert await call is True
    assert loop.time() - t0 >= 0.05  # not before it had been quiet quiet_s
    # reporting again within quiet_s brings the news with that report: no call
    w.reported("a")
    call = asyncio.create_task(w.wait("a", timeout_s=0.3))
    await asyncio.sleep(0)
    w.placed("b")
    w.reported("a")
    assert await call is False


async def test_a_second_watch_of_a_lease_answers_the_first_and_a_forgotten_lease_is_answered() -> None:
    w = PlacementWatch()
    first = asyncio.create_task(w.wait("a", timeout_s=30))
    await asyncio.sleep(0)
    second = asyncio.create_task(w.wait("a", timeout_s=30))
    assert await first is False
    await asyncio.sleep(0)
    assert w.parked() == 1  # the first call's end left the second parked
    w.reported("a")
    w.forget("a")
    assert await second is False
    assert w.parked() == 0


def _in_flight(view: FleetView | None) -> int:
    assert view is not None
    return sum(e.inflight for e in view.facts().values())


@pytest.mark.parametrize("watching", [True, False])
async def test_another_leases_placement_reaches_a_quiet_lease_at_once_with_the_watch(watching: bool) -> None:
    svc, clock = scheduler_service({"mode": "open", "phase_concurrency": {"prefill": 8, "decode": 8}})

    async def send(rep: Report) -> object:
        return svc.report(rep)

    renewed = {"a": asyncio.Event(), "b": asyncio.Event()}
    reps = {}
    for name in ("a", "b"):
        r = Reporter(send, lease=AdmissionLease(name), watch=svc.watch if watching else None, linger_s=0,
                     renew_s=60, clock=clock, mono=clock)  # (no renewal within the test)
        r.on_view = lambda _v, ev=renewed[name]: ev.set()
        r.start()
        reps[name] = r
    for r in reps.values():
        await r.flush()
    b = reps["b"].lease
    assert b is not None
    before = _in_flight(b.current_view())
    renewed["b"].clear()
    a = reps["a"].lease
    assert a is not None
    got = a.try_admit("t1", Ask(10, 2.0), clock() + 60, clock(), clock())
    assert isinstance(got, Placement)
    reps["a"].offered()  # (the gateway's report of the request, which carries the placement)
    await reps["a"].flush()
    try:
        if watching:
            await asyncio.wait_for(renewed["b"].wait(), 5)
            assert _in_flight(b.current_view()) == before + 1
            assert reps["b"].news == 1
        else:  # only its next renewal, 60 s away, would bring it
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(renewed["b"].wait(), 0.2)
            assert _in_flight(b.current_view()) == before
    finally:
        for r in reps.values():
            await r.stop()
    assert svc.placement_watch.parked() == 0  # the stopped reporters' calls were cancelled


def test_a_placement_made_outside_the_event_loop_still_answers_a_parked_watch() -> None:
    """The scheduler's code also runs from synchronous callers (tests step a loop by hand): a
    placement between two steps answers the parked call on its own loop."""
    loop = asyncio.new_event_loop()
    try:
        w = PlacementWatch(quiet_s=0)
        call = loop.create_task(w.wait("a", timeout_s=30))
        loop.run_until_complete(asyncio.sleep(0))
        assert w.parked() == 1
        w.placed("b")  # no loop running here
        assert loop.run_until_complete(call) is True
    finally:
        loop.close()


async def test_a_placement_the_scheduler_makes_for_a_lease_is_news_for_the_others_only() -> None:
    svc, clock = scheduler_service({"mode": "open", "phase_concurrency": {"prefill": 8, "decode": 8}})
    for name in ("a", "b"):
        svc.report(Report(lease=LeasePart(name, 1)))
    clock.t += 1
    await asyncio.sleep(0.02)  # both quiet
    watch_a = asyncio.create_task(svc.placement_watch.wait("a", timeout_s=0.3))
    watch_b = asyncio.create_task(svc.placement_watch.wait("b", timeout_s=5))
    await asyncio.sleep(0)
    res = await svc.admit(AdmitRequest("t1", clock.t + 60, 10, 10, 30.0, kind="completion", lease_id="a"))
    assert res.error is None
    assert await watch_b is True  # a's request, placed by the scheduler: news for b
    assert await watch_a is False  # a hears of its own with the admit's answer


async def test_a_lease_is_not_called_for_what_its_own_reports_answer_holds() -> None:
    """A report that frees a permit lets the scheduler's queue place another lease's request
    while the report is handled; the grant answering it holds that placement, so the reporting
    lease's parked watch is not answered for it (found by a review: one extra report each time)."""
    svc, clock = scheduler_service({"mode": "open", "phase_concurrency": {"prefill": 1, "decode": 1}})
    r0 = await svc.admit(AdmitRequest("t0", clock.t + 60, 10, 10, 30.0, kind="completion"))
    assert r0.error is None
    queued = asyncio.create_task(
        svc.admit(AdmitRequest("t1", clock.t + 60, 10, 10, 30.0, kind="completion", lease_id="b")))
    await asyncio.sleep(0)
    assert not queued.done()
    svc.report(Report(lease=LeasePart("a", 1)))
    await asyncio.sleep(0.02)  # a is quiet
    call = asyncio.create_task(svc.watch("a"))
    await asyncio.sleep(0)
    assert svc.report(Report(lease=LeasePart("a", 2), released=[("t0", None, True)])) is not None
    assert (await queued).error is None  # placed while a's report was handled
    await asyncio.sleep(0.05)  # past the quiet time
    assert not call.done()
    svc.report(Report(lease=LeasePart("b", 1)))  # b's own placement, reported: still nothing new for a
    await asyncio.sleep(0.05)
    assert not call.done()
    call.cancel()


async def test_a_reaped_lease_is_forgotten_by_the_watch() -> None:
    svc, clock = scheduler_service({"mode": "open"})
    svc.report(Report(lease=LeasePart("a", 1)))
    call = asyncio.create_task(svc.watch("a"))
    await asyncio.sleep(0)
    assert svc.placement_watch.parked() == 1
    clock.t += ORPHAN_S + 1
    svc.reap()
    assert await call is False
    w = svc.placement_watch
    assert "a" not in w._heard and "a" not in w._reported and w.parked() == 0


async def test_a_watch_answer_as_the_reporter_stops_starts_nothing_after_the_stop() -> None:
    """stop() cancels the reporter's tasks; a watch answer landing in the same turn (its flush
    starting a report loop) leaves no task running after it (found by a review)."""
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[bool] = loop.create_future()
    sends = 0
    hold = asyncio.Event()

    async def send(rep: Report) -> None:
        nonlocal sends
        sends += 1
        if sends == 1:
            return None
        try:
            await hold.wait()  # a report in flight when stop() comes
        except asyncio.CancelledError:
            if not gate.done():
                gate.set_result(True)  # the watch's answer lands in the same loop turn
            raise

    async def watch(lease_id: str) -> bool:
        return await gate

    r = Reporter(send, lease=AdmissionLease("a"), watch=watch, linger_s=0, renew_s=0.01)
    r.start()
    for _ in range(100):  # first report answered, the second in flight
        if sends >= 2:
            break
        await asyncio.sleep(0.005)
    assert sends >= 2
    before = set(asyncio.all_tasks())
    await r.stop()
    await asyncio.sleep(0.05)
    leaked = [t for t in asyncio.all_tasks() if t not in before and not t.done()]
    for t in leaked:
        t.cancel()
    assert not leaked and sends == 2
