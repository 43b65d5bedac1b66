"""Draining and the router lease (narwhal_serve/drain.py, ha/, scheduler/ha.py, scheduler/admin.py,
gateway/completion.py), from a review: each test failed before its fix.
No Redis: a fake lease backend, virtual monotonic clocks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from narwhal_serve.admission.core import FleetView
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.gateway.completion import CompletionHandler
from narwhal_serve.ha.lease import RouterLease, safety_margin
from narwhal_serve.ha.redis_lease import LeaseAnswer
from narwhal_serve.scheduler.ha import RouterHA
from narwhal_serve.scheduler.messages import AdmitRequest
from tests.support.scheduler import scheduler_service

LEASE = {"backend": "redis", "url": "redis://127.0.0.1:1/0", "key": "k", "ttl_s": 10.0, "renew_s": 3.0}


class Mono:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


class FakeBackend:
    """A Redis lease that always lets its caller have the lease (epoch 7)."""

    def __init__(self) -> None:
        self.calls = 0
        self.released: list[int] = []

    async def acquire_or_renew(self, holder_id: str, ttl_s: float, seen_epoch: int, held_epoch: int = 0) -> LeaseAnswer:
        self.calls += 1
        return LeaseAnswer(True, 7, holder_id)

    async def release(self, holder_id: str, epoch: int, keep_ms: int = 0) -> None:
        self.released.append(epoch)

    async def close(self) -> None:
        pass


def req(tid: str) -> AdmitRequest:
    return AdmitRequest(tid, 2000.0, 10, 16, 2.0)


def leased_service():  # type: ignore[no-untyped-def]
    svc, clock = scheduler_service({"mode": "open"}, ha={"lease": LEASE})
    mono = Mono()
    svc.ha.mono = mono
    backend = FakeBackend()
    svc.ha.backend = backend  # type: ignore[assignment]
    svc.ha.lease.on_answer(True, 7, svc.ha.lease.holder_id, sent_at=mono.t)  # active under epoch 7
    return svc, clock, mono, backend


async def test_after_releasing_its_lease_the_router_still_admits_under_the_released_epoch() -> None:
    # RouterHA.release (scheduler/ha.py:131-145) deletes the key in Redis but leaves RouterLease
    # untouched (epoch 7, valid_until ~9 s ahead): lease_mode() stays "active", so the router keeps
    # admitting and granting ingress leases (ingress_ttl > 0) under epoch 7 while the standby takes
    # the lease at its next renewal with epoch 8 -- two active routers.  docs/operations.md ("Failover":
    # a clean stop "releases the lease at once ... new requests go to the new active") and ha/lease.py
    # ("active — this router holds the lease") say a router that handed its lease over admits nothing.
    svc, _, mono, backend = leased_service()
    assert (await svc.admit(req("before"))).error is None
    await svc.ha.release()
    assert backend.released == [7]  # the key is gone in Redis: any other router may take it now
    after = await svc.admit(req("after"))
    assert after.error is not None and after.error.code == "router_unavailable", \
        f"admitted under the released epoch {after.epoch} (lease mode {svc.ha.lease_mode()})"


async def test_an_exception_in_the_lease_loops_on_change_ends_the_renewals_for_good() -> None:
    # RouterHA.run (scheduler/ha.py:88-98) calls on_change (the scheduler's _pump) with no guard:
    # one exception from it ends the loop; its `finally` releases the lease (the standby takes over)
    # while the router's own lease still reads "active" for up to 0.9 x ttl, and `_released` stops
    # every later renewal: the router is then fenced for good.  The monitor loop beside it
    # (scheduler/service.py:64-72) survives a failed pass; the lease loop must too (it renews
    # every renew_s "until cancelled", its own docstring).
    cfg = NarwhalConfig.model_validate({"ha": {"lease": {**LEASE, "ttl_s": 1.0, "renew_s": 0.01}}})
    ha = RouterHA(cfg)
    backend = FakeBackend()
    ha.backend = backend  # type: ignore[assignment]
    changes = 0

    def on_change() -> None:
        nonlocal changes
        changes += 1
        if changes == 2:
            raise RuntimeError("a fault in _pump")

    task = asyncio.get_running_loop().create_task(ha.run(on_change))
    try:
        await asyncio.sleep(0.15)
        alive = not task.done()
        calls, released = backend.calls, list(backend.released)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert alive and calls >= 5 and released == [], \
        f"the lease loop died after {calls} renewals and released the lease {released}"


async def test_a_drained_router_says_fenced_not_draining_once_its_released_lease_lapses() -> None:
    # POST /admin/drain (scheduler/api.py:62-65) drains and releases the lease; the RouterLease keeps
    # its epoch, so at valid_until mode() turns "fenced", and SchedulerState._unavailable_now
    # (scheduler/state.py:309-313) puts the lease mode before RouterState.unavailable_reason (which
    # itself puts draining first, ha/state.py:24).  docs/contract.md ("Routes", POST /admin/drain:
    # "503 router_unavailable, reason draining; /ready 503") and operations.md ("Stopping": "/ready 503
    # draining") give draining for the whole drain; "fenced" means "lost its lease without handing it
    # over" (operations.md, router states), which is false here.  (A drained standby says "standby".)
    svc, clock, mono, _ = leased_service()
    svc.drain(30.0, clock.t)
    await svc.ha.release()
    assert svc.readiness() == (False, "draining")
    mono.t += 10.0  # 10 s into a 30 s grace: the released lease has lapsed on the router's clock
    clock.t += 10.0
    for e in svc.engines.values():
        e.last_ok = clock.t
    svc.ha.last_pass = clock.t
    assert svc.readiness() == (False, "draining")


async def test_the_drain_timer_ignores_the_views_clock_shift_and_cuts_streams_before_the_grace() -> None:
    # FleetView.streams_end_at is the scheduler's wall time; an ingress lease's view carries `shift`
    # (admission/lease.py:270: ingress now - scheduler now; admission/view.py:24 "seconds to add to
    # the scheduler's times"), which every other time read from the view adds.  on_view
    # (gateway/completion.py:114-120) compares streams_end_at with the ingress' own clock unshifted:
    # an ingress whose clock runs 20 s ahead of the scheduler's ends the streams 20 s before the
    # grace the operator gave (docs/operations.md "Stopping": streams still open when the grace has
    # passed are ended -- not before).  Correct: schedule at streams_end_at + view.shift.
    cfg = NarwhalConfig.model_validate({})
    ingress_now = 1020.0  # the scheduler's clock reads 1000.0 now
    handler = CompletionHandler(cfg, SimpleNamespace(local_relay=None), None, clock=lambda: ingress_now)  # type: ignore[arg-type]
    view = FleetView(engines=(), unavailable="draining", predictive=False, streams_end_at=1000.0 + 30.0, shift=20.0)
    loop = asyncio.get_running_loop()
    handler.on_view(view)
    assert handler._drain_timer is not None
    delay = handler._drain_timer.when() - loop.time()
    handler._drain_timer.cancel()
    assert delay > 29.0, f"the streams are ended {delay:.1f} s from now, not after the 30 s grace"


def test_a_late_renewal_answer_makes_a_fenced_router_active_again_under_its_fenced_epoch() -> None:
    # ha/lease.py docstring: fenced -- "it admits nothing, and never again under that epoch";
    # docs/operations.md ("Fenced"): "it never admits again under that epoch (when it can renew again
    # and Redis still has its key, it takes a new epoch)".  A renewal sent just before valid_until
    # (held_epoch 7) whose answer arrives after mode() has fenced the router makes it active again
    # under epoch 7 (on_answer, lease.py:42-51, takes any won answer).  Safe (Redis still held me:7) but
    # it breaks the fencing promise; correct: a won answer for the fenced epoch is not accepted (the
    # next renewal, held 0, takes a new epoch), or the docs must say otherwise.
    lease = RouterLease("me", ttl_s=10.0)
    lease.on_answer(True, 7, "me", sent_at=0.0)
    stop = 10.0 - safety_margin(10.0)
    sent = stop - 0.1  # the last renewal goes out while still active, held_epoch 7
    assert lease.mode(sent) == "active"
    assert lease.mode(stop) == "fenced" and lease.fenced_epoch == 7  # admissions stop here
    lease.on_answer(True, 7, "me", sent_at=sent)  # its answer, 0.3 s later
    assert not (lease.mode(stop + 0.2) == "active" and lease.epoch == 7), "active again under the fenced epoch 7"
