"""Admission leases against a real SchedulerService (no Ray, virtual clocks): local admission makes
no scheduler call, permits never sum past a limit, FIFO with the scheduler's queue, expiry, the
scheduler forgetting a lease, and charges moving to the route actually served."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from narwhal_serve.admission.controller import NONE, Permits, Refusal
from narwhal_serve.admission.core import Ask, Placement
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.scheduler.leases import LEASE_TTL_S, ORPHAN_S
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from narwhal_serve.scheduler.service import SchedulerService
from tests.support.scheduler import Clock, scheduler_service


def service(mode: str = "open", prefill: int = 4, decode: int = 8, retention: int = 16) -> tuple[SchedulerService, Clock]:
    return scheduler_service(
        {"mode": mode, "queue_limit": 4, "max_wait_s": 5, "phase_concurrency": {"prefill": prefill, "decode": decode}},
        {"http_retention_limit": retention},
    )


class Holder:
    """An ingress replica's lease, exchanging reports with ``svc`` directly."""

    def __init__(self, svc: SchedulerService, clock: Clock, name: str = "i1") -> None:
        self.svc, self.clock = svc, clock
        self.lease = AdmissionLease(name)
        self.mono = 0.0

    def sync(self) -> None:
        part = self.lease.cut(self.mono)
        grant = self.svc.report(Report(lease=part))
        assert grant is not None
        self.lease.apply(grant, self.clock(), self.mono)

    def admit(self, tid: str, prompt: int = 10, budget: float = 2.0) -> Placement | Refusal | None:
        return self.lease.try_admit(tid, Ask(prompt, budget), self.clock() + 60, self.clock(), self.mono)


def held(svc: SchedulerService) -> Permits:
    c = svc.admission
    return Permits(len(c.retained), c.prefill, c.decode) + c.reserved


async def test_local_admission_needs_no_scheduler_call_and_is_charged_on_report() -> None:
    svc, clock = service()
    h = Holder(svc, clock)
    assert h.admit("a") is None  # no grant yet: ask the scheduler
    h.sync()
    calls = {"admit": 0, "report": 0}
    orig_admit, orig_report = svc.admit, svc.report

    async def counting_admit(req: AdmitRequest) -> object:
        calls["admit"] += 1
        return await orig_admit(req)

    def counting_report(rep: Report) -> object:
        calls["report"] += 1
        return orig_report(rep)

    svc.admit = counting_admit  # type: ignore[method-assign, assignment]
    svc.report = counting_report  # type: ignore[method-assign, assignment]
    placements = [h.admit(f"t{i}") for i in range(2)]
    assert all(isinstance(p, Placement) for p in placements)
    assert calls == {"admit": 0, "report": 0}
    assert svc.admission.gauges()["prefill_inflight"] == 0  # not reported yet
    h.sync()
    g = svc.admission.gauges()
    assert (g["retained"], g["prefill_inflight"], g["decode_inflight"]) == (2, 2, 2)
    assert sum(e.inflight for e in svc.engines.values()) >= 2
    for i in range(2):
        h.lease.release(f"t{i}")
    h.sync()
    assert svc.admission.gauges() == {"retained": 0, "queued": 0, "prefill_inflight": 0, "decode_inflight": 0}
    svc.report(Report(released=[("t0", None, False), ("t1", None, False)]))
    assert all(e.inflight == 0 and e.pending_prefill_tokens == 0 and e.pending_prefill_requests == 0 for e in svc.engines.values())


async def test_leases_never_sum_past_a_limit() -> None:
    svc, clock = service(prefill=3, decode=5, retention=16)
    holders = [Holder(svc, clock, f"i{k}") for k in range(3)]
    admitted = 0
    for rnd in range(6):
        for h in holders:
            h.sync()
            while isinstance(h.admit(f"{h.lease.lease_id}-{rnd}-{admitted}"), Placement):
                admitted += 1
            assert svc.admission.limits().covers(held(svc))
            in_use = sum((x.lease.in_use for x in holders), NONE)
            spare = sum((x.lease.spare for x in holders), NONE)
            assert held(svc).covers(in_use + spare)  # reserved ≥ what the leases hold
    assert admitted == 3  # the prefill limit, across three replicas
    # the scheduler's own path sees the limit too: queued, not granted
    fut = asyncio.ensure_future(svc.admit(AdmitRequest("s1", clock.t + 60, 10, 4, 2.0)))
    await asyncio.sleep(0)
    assert svc.admission.gauges()["queued"] == 1 and not fut.done()
    svc.cancel("s1")
    await fut


async def test_queued_requests_go_first_and_spare_permits_come_back() -> None:
    svc, clock = service(prefill=1, decode=2, retention=3)
    h = Holder(svc, clock)
    h.sync()
    assert h.lease.spare.prefill == 1  # the only prefill permit is the lease's spare
    assert isinstance(h.admit("a"), Placement)
    assert h.admit("b") is None  # no prefill permit left: ask the scheduler
    back = h.lease.give_back_spare()
    waiter = asyncio.ensure_future(svc.admit(AdmitRequest("b", clock.t + 60, 10, 4, 2.0, lease_id="i1", returned=back)))
    await asyncio.sleep(0)
    assert svc.admission.gauges()["queued"] == 1
    h.sync()  # the queue is not empty: no spare target, no local admission
    assert h.lease.spare_target == NONE
    assert h.admit("c") is None
    h.lease.release("a")
    h.sync()  # a's permits go back to the scheduler, which grants b
    result = await waiter
    assert result.error is None and result.candidates
    assert svc.admission.gauges()["queued"] == 0


async def test_expired_lease_defers_and_hands_its_spare_back() -> None:
    svc, clock = service()
    h = Holder(svc, clock)
    h.sync()
    assert h.lease.spare.any()
    h.mono += LEASE_TTL_S + 0.01  # no answer for a whole TTL
    assert h.admit("a") is None
    part = h.lease.cut(h.mono)
    assert part.returned.any() and h.lease.spare == NONE
    svc.report(Report(lease=part))
    assert svc.admission.reserved.covers(NONE)


async def test_refusals_are_decided_locally_with_the_same_rows() -> None:
    svc, clock = service("predictive")
    h = Holder(svc, clock)
    h.sync()
    verdict = h.admit("long", prompt=100_000, budget=0.5)
    assert isinstance(verdict, Refusal) and verdict.reason == "prompt_exceeds_ttft_budget"
    assert h.lease.in_use == NONE


async def test_state_refusals_are_left_to_the_scheduler() -> None:
    """A view that says "standby" or "no eligible engine" may be a renewal old: the scheduler,
    whose state is current, answers instead (seen in CI: a 503 just after /ready said 200)."""
    svc, clock = service()
    h = Holder(svc, clock)
    h.sync()
    svc.set_mode("standby")
    h.sync()
    assert h.admit("x") is None
    refused = await svc.admit(AdmitRequest("x", clock() + 60, 10, 16, 2.0))
    assert refused.error is not None and refused.error.code == "router_unavailable"
    svc.set_mode("active")  # promoted; the lease has not heard yet
    assert h.admit("y") is None
    admitted = await svc.admit(AdmitRequest("y", clock() + 60, 10, 16, 2.0))
    assert admitted.error is None
    for e in svc.engines.values():
        e.healthy = False
    svc.views_stale()  # (as the scrape pass that found them down does)
    h.sync()
    assert h.admit("z") is None
    assert h.lease.in_use == NONE


async def test_a_forgotten_lease_keeps_its_requests_and_loses_its_spare() -> None:
    svc, clock = service()
    h = Holder(svc, clock)
    h.sync()
    assert isinstance(h.admit("a"), Placement)
    h.sync()
    clock.t += ORPHAN_S + 1  # the ingress went silent: the scheduler forgets the lease
    svc.reap()
    assert svc.admission.reserved == NONE and not svc.leases.leases
    h.sync()  # it comes back: its request in use is reserved again, its old spare is void
    assert h.lease.in_use == Permits(1, 1, 1)
    assert svc.admission.reserved.covers(h.lease.in_use + h.lease.spare)


def holds(h: Holder) -> Permits:
    return h.lease.in_use + h.lease.spare + h.lease._to_return


async def test_a_scheduler_restart_under_load_neither_leaks_nor_over_admits() -> None:
    svc, clock = service(prefill=4, decode=8, retention=16)
    h = Holder(svc, clock)
    h.sync()
    for t in ("a", "b"):
        assert isinstance(h.admit(t), Placement)
    h.sync()
    new, _ = service(prefill=4, decode=8, retention=16)  # the scheduler restarts, empty
    h.svc = new
    part = h.lease.cut(h.mono)  # the first report to the new scheduler is in flight...
    h.lease.release("a")  # ...while one request ends (its permits were in use at the cut)
    assert isinstance(h.admit("c"), Placement)  # ...and one is admitted on the old, void spare
    grant = new.report(Report(lease=part))
    assert grant is not None
    h.lease.apply(grant, clock(), h.mono)
    # the lease holds exactly what the new record reserved: a's freed permits count, c's is a deficit
    assert new.admission.reserved == holds(h)
    for _ in range(3):
        h.sync()
        assert new.admission.reserved.covers(holds(h))
        assert new.admission.limits().covers(new.admission.reserved)
    h.lease.release("b")
    h.lease.release("c")
    for _ in range(2):
        h.sync()
    assert new.admission.reserved == holds(h)  # nothing leaked: the lease holds all it is charged for


async def test_spare_returned_under_a_forgotten_record_is_ignored() -> None:
    svc, clock = service()
    h = Holder(svc, clock)
    h.sync()
    stale = h.lease.give_back_spare()  # an admit call carrying these is slow to arrive...
    old_epoch = h.lease.epoch
    clock.t += ORPHAN_S + 1
    svc.reap()  # ...the scheduler forgets the lease (its spare came back) and it re-registers
    h.sync()
    before = svc.admission.reserved
    svc.leases.returned(h.lease.lease_id, stale, old_epoch)  # the late return: void, not subtracted
    assert svc.admission.reserved == before
    assert svc.admission.reserved.covers(holds(h))


async def test_charges_move_to_the_route_that_served() -> None:
    svc, clock = service()
    h = Holder(svc, clock)
    h.sync()
    p = h.admit("a")
    assert isinstance(p, Placement)
    h.sync()
    charged = p.engines
    other = next(r.engines for r in p.routes if r.engines != charged)
    svc.report(Report(decode_started=[("a", other)]))
    assert all(svc.engines[n].inflight == 1 for n in other)
    assert all(svc.engines[n].inflight == 0 for n in charged if n not in other)
    svc.report(Report(released=[("a", None, False)]))
    assert all(e.inflight == 0 and e.pending_prefill_tokens == 0 and e.pending_prefill_requests == 0 for e in svc.engines.values())


async def test_scheduler_reaps_tickets_past_their_deadline() -> None:
    svc, clock = service()
    r = await svc.admit(AdmitRequest("a", clock.t + 1, 10, 4, 2.0))
    assert r.error is None
    clock.t += 10
    svc.reap()
    assert svc.admission.gauges()["retained"] == 0
    assert all(e.inflight == 0 for e in svc.engines.values())


async def test_predictive_over_admission_across_replicas_is_bounded_by_the_others_spare() -> None:
    """Each replica decides on the others as last known: between two reports, the others' new
    admissions are invisible to it. Against one global decider, the excess is at most the other
    replicas' spare prefill permits (what they can admit before they report)."""
    svc, clock = service("predictive", prefill=64, decode=256, retention=256)
    for e in svc.engines.values():
        e.ttft_model.a, e.ttft_model.b = 0.1, 0.001  # 100 ms + 1 ms per prompt token ahead
    holders = [Holder(svc, clock, f"i{k}") for k in range(3)]
    for h in holders:
        h.sync()
    budget, prompt = 0.5, 100  # a route fits 4 such prompts in its queue within budget
    # the global decider's answer: one holder admitting alone, reporting after every admission
    solo, _ = service("predictive", prefill=64, decode=256, retention=256)
    for e in solo.engines.values():
        e.ttft_model.a, e.ttft_model.b = 0.1, 0.001
    alone = Holder(solo, clock, "solo")
    alone.sync()
    global_ok = 0
    while isinstance(alone.admit(f"g{global_ok}", prompt, budget), Placement):
        global_ok += 1
        alone.sync()
    # now three replicas admit on the same view without reporting in between
    admitted = [0, 0, 0]
    for k, h in enumerate(holders):
        while isinstance(h.admit(f"{k}-{admitted[k]}", prompt, budget), Placement):
            admitted[k] += 1
    spare = [h.lease.spare_target.prefill for h in holders]
    excess = sum(admitted) - global_ok
    assert 0 < excess <= sum(spare) - spare[0]
    assert all(a <= s for a, s in zip(admitted, spare))  # no replica past its own permits


async def test_a_view_kept_through_a_grant_that_is_not_for_it_stays_in_one_clock() -> None:
    """A grant whose changes are against a view this lease does not hold leaves it its view, moved
    into its clock once (the shift is the clocks' difference now, not that added to the last one:
    the head of a line's progress and engines' eligibility are read through it)."""
    svc, clock = service("predictive")
    h = Holder(svc, clock)
    part = h.lease.cut(h.mono)
    grant = svc.report(Report(lease=part))
    assert grant is not None
    h.lease.apply(grant, clock() + 5.0, h.mono)  # this replica's clock 5 s ahead of the scheduler's
    assert h.lease.view is not None and h.lease.view.shift == pytest.approx(5.0)
    for _ in range(2):
        part = h.lease.cut(h.mono)
        again = svc.report(Report(lease=part))
        assert again is not None
        h.lease.apply(dataclasses.replace(again, view_base=again.view_seq + 99), clock() + 5.0, h.mono)
        assert h.lease.view is not None and h.lease.view.shift == pytest.approx(5.0)
