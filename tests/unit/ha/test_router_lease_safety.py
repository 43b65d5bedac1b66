"""Review of the router lease (ha/redis_lease.py, ha/lease.py, scheduler/ha.py): fencing-token
monotonicity when Redis comes back with *older* data, and the ingress leases a released router
leaves behind.  Each test fails on the code as reviewed and passes once its defect is fixed.

They run against a real ``redis-server`` on 127.0.0.1 (tests/support/redis_server.py, as the other
tests of this folder), stopped by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis

from narwhal_serve.admission.core import Ask, Placement
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.ha.redis_lease import RedisLease
from narwhal_serve.scheduler.ha import RouterHA
from narwhal_serve.scheduler.messages import Report
from tests.support.redis_server import RedisServer, lease_router
from tests.support.scheduler import scheduler_service
from tests.unit.ha.test_redis_semantics import close

TTL, RENEW = 2.0, 0.4
KEY = "narwhal:review-lease"


def admin(server: RedisServer) -> "redis.Redis[bytes]":
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2, protocol=2)


def router(url: str) -> RouterHA:
    return lease_router(url, key=KEY, ttl=TTL, renew=RENEW)


async def answered(ha: RouterHA, tries: int = 5) -> None:
    """One renewal that Redis answered (the first after a restart may fail on a stale connection)."""
    for _ in range(tries):
        await ha.renew_once()
        if ha.lease is not None and ha.lease.last_error is None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no answer from Redis: {ha.view()}")


async def acquire(ha: RouterHA) -> None:
    end = time.monotonic() + TTL + 2.0
    while ha.lease_mode() != "active":
        if time.monotonic() > end:
            raise AssertionError(f"not active: {ha.view()}")
        await ha.renew_once()
        await asyncio.sleep(0.05)


def restart_from_snapshot(server: RedisServer) -> None:
    """A crash of a Redis that persists by RDB snapshots (Redis' default `save` points, or AOF
    `everysec`): it comes back with the data of its last snapshot, not its last write."""
    server.stop()  # SIGKILL: nothing written since the snapshot survives
    server.start()  # loads dump.rdb from its --dir


# -- 1. a Redis that comes back with an older epoch counter gives the lease away at once ---------
async def test_redis_back_with_an_older_counter_gives_no_second_active(redis_server: RedisServer) -> None:
    """docs/operations.md ("Running two routers"): the active "stops admitting at ttl_s minus a 10 %
    margin — before Redis can give the lease to anyone else", and when Redis loses its data "a
    router that had seen epochs before finds the lease held by nobody ... for one ttl_s — the time
    the old holder may still be active under a lease Redis forgot".  ACQUIRE_OR_RENEW only treats
    a *missing* epoch counter as lost data (redis_lease.py: `EXISTS KEYS[2]`): a Redis restored
    from a snapshot has the counter, only older, and no lease key — the standby takes the lease at
    once (INCR, lifted above its floor) while the old holder is still active by its own clock."""
    x = router(redis_server.url)
    await acquire(x)
    await x.release()  # the counter is at x's epoch; no lease key
    assert admin(redis_server).save()  # the last snapshot
    a, b = router(redis_server.url), router(redis_server.url)
    try:
        await acquire(a)  # a newer epoch, written after the snapshot
        await answered(b)
        assert a.lease_mode() == "active" and b.lease_mode() == "standby"
        assert b.lease is not None and b.lease.seen_epoch == a.epoch()
        restart_from_snapshot(redis_server)
        await answered(b)
        both = a.lease_mode() == "active" and b.lease_mode() == "active"
        assert not both, f"two actives after Redis came back with older data: a {a.view()} / b {b.view()}"
    finally:
        await close(a, b)


# -- 2. ... and hands a router that has seen no epoch an epoch already used -----------------------
async def test_epochs_never_repeat_when_redis_comes_back_with_an_older_counter(redis_server: RedisServer) -> None:
    """docs/operations.md: "Epochs never repeat, even after Redis loses its data".  The counter a
    snapshot restored is older than the epochs handed out since, and INCR is only lifted above the
    *calling* router's floor: a router process that has seen no epoch (a restarted standby, a
    rolling restart) is handed an epoch another router already held — the fencing token engines
    get as X-Narwhal-Epoch repeats."""
    x = router(redis_server.url)
    await acquire(x)
    await x.release()
    assert admin(redis_server).save()
    y = router(redis_server.url)
    await acquire(y)
    used = y.epoch()  # handed out after the snapshot
    await y.release()
    restart_from_snapshot(redis_server)
    fresh = router(redis_server.url)
    try:
        await answered(fresh)
        await acquire(fresh)
        assert fresh.epoch() > used, f"epoch {fresh.epoch()} repeats one handed out before (up to {used})"
    finally:
        await close(fresh)


# -- 3. a released router's ingress leases keep admitting under the new active -------------------
async def test_ingress_leases_do_not_outlive_a_released_router_lease(redis_server: RedisServer) -> None:
    """docs/operations.md ("Fenced"): "The admission leases it hands its ingress replicas never
    outlive its own lease"; ha/lease.py: "Leases handed to ingress replicas never outlive
    RouterLease.remaining".  A clean stop (`POST /admin/drain`, SIGTERM → scheduler/api.py "drain":
    svc.drain then ha.release) DELetes the Redis key at once, and RouterLease.released() ends the
    router's own lease, but the admission leases it granted moments before (valid up to
    LEASE_TTL_S = 2 s, scheduler/leases.py) are untouched: their ingress replicas keep admitting
    locally on their pre-drain view while the standby, which took the free key at its next
    renewal, admits too — two admitters on the same engines."""
    url = redis_server.url
    svc, clock = scheduler_service(
        {"mode": "open"}, ha={"lease": {"backend": "redis", "url": url, "key": KEY, "ttl_s": TTL, "renew_s": RENEW}})
    svc.ha.mono = time.monotonic
    svc.ha.backend = RedisLease(url, KEY, timeout_s=RENEW)
    b = router(url)
    try:
        await acquire(svc.ha)
        await answered(b)
        assert svc.ha.lease_mode() == "active" and b.lease_mode() == "standby"
        ingress = AdmissionLease("i1")  # an ingress replica of the active router
        cut = time.monotonic()
        grant = svc.report(Report(lease=ingress.cut(cut)))
        assert grant is not None and grant.ttl_s > 0
        ingress.apply(grant, clock(), cut)
        svc.drain(30.0, clock())  # what scheduler/api.py does for op "drain"...
        await svc.ha.release()  # ...then hands the lease over
        await answered(b)  # the standby's next renewal
        verdict = ingress.try_admit("after-release", Ask(10, 2.0), clock() + 60, clock(), time.monotonic())
        both = b.lease_mode() == "active" and isinstance(verdict, Placement)
        assert not both, (f"the released router's ingress still admits locally ({ingress.valid_until - time.monotonic():.2f} s "
                          f"left) while {b.lease.holder_id if b.lease else None} is active under epoch {b.epoch()}")
    finally:
        await close(svc.ha, b)


# -- 4. a stop that cancels the renewal in flight releases before that renewal lands -------------
async def test_a_stop_during_a_renewal_in_flight_still_hands_the_lease_over(redis_server: RedisServer) -> None:
    """docs/operations.md ("Failover"): a clean stop (`serve shutdown`: deployments/scheduler.py
    __del__ → SchedulerService.stop) "releases the lease at once (after the renewal in flight, if
    one is: a renewal that reached Redis after the release would take the lease back)".
    SchedulerService.stop *cancels* the lease task: the renewal in flight is abandoned, not waited
    for (RouterHA._calls is left as the cancellation unwinds renew_once), and release() DELetes the
    key at once.  The abandoned renewal's command is already on the wire; when it reaches Redis
    after the DEL it finds no key and takes a new epoch for the stopped router — the standby waits
    a whole ttl_s."""
    a, b = router(redis_server.url), router(redis_server.url)
    wire = RedisLease(redis_server.url, KEY, timeout_s=RENEW)  # the packets already sent
    loop = asyncio.get_running_loop()
    late: list[asyncio.Task[object]] = []
    try:
        await acquire(a)
        await answered(b)
        assert a.lease_mode() == "active" and b.lease_mode() == "standby"
        assert a.backend is not None

        async def sent_then_delayed(**kw: object) -> object:
            async def arrives() -> object:
                await asyncio.sleep(0.3)  # a retransmitted segment, a slow link
                return await wire._acquire(**kw)  # type: ignore[arg-type]

            late.append(loop.create_task(arrives()))
            return await asyncio.shield(late[-1])  # cancelling the caller does not unsend it

        a.backend._acquire = sent_then_delayed  # type: ignore[assignment]
        task = loop.create_task(a.run(lambda: None))  # the scheduler's lease loop: renews at once
        await asyncio.sleep(0.1)
        assert late, "no renewal in flight"
        task.cancel()  # SchedulerService.stop
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its finally releases the lease
        await asyncio.gather(*late, return_exceptions=True)  # the renewal has reached Redis by now
        await answered(b)
        holder = admin(redis_server).get(KEY)
        assert b.lease_mode() == "active", (f"not handed over: key {holder!r} (the stopped router is "
                                              f"{a.lease.holder_id if a.lease else None}) for ttl_s")
    finally:
        await asyncio.gather(*late, return_exceptions=True)
        with contextlib.suppress(Exception):
            await wire.close()
        await close(a, b)


async def test_no_admission_lease_is_granted_once_the_release_began() -> None:
    """The release shortens the key to the end of the admission leases granted so far: one granted
    during its round trip to Redis would outlive it (a review of this fix found it)."""
    from narwhal_serve.config import NarwhalConfig
    from narwhal_serve.scheduler.ha import RouterHA

    cfg = NarwhalConfig.model_validate({"ha": {"lease": {"backend": "redis", "url": "redis://127.0.0.1:9/0"}}})
    t = [100.0]
    ha = RouterHA(cfg, mono=lambda: t[0])
    assert ha.lease is not None
    ha.lease.on_answer(True, 5, ha.lease.holder_id, sent_at=t[0])
    assert ha.ingress_ttl(2.0) == 2.0
    at_redis, go = asyncio.Event(), asyncio.Event()
    kept: list[int] = []

    class Slow:
        async def release(self, holder: str, epoch: int, keep_ms: int = 0) -> None:
            kept.append(keep_ms)
            at_redis.set()
            await go.wait()

        async def close(self) -> None:
            pass

    ha.backend = Slow()  # type: ignore[assignment]
    releasing = asyncio.create_task(ha.release())
    await at_redis.wait()
    granted = ha.ingress_ttl(2.0)  # a report answered while the release is on its way
    go.set()
    await releasing
    assert granted == 0.0 and kept == [2000]
