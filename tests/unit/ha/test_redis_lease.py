"""Two routers' leases against a real Redis server: contention, takeover, a lost Redis."""

from __future__ import annotations

import asyncio

from narwhal_serve.scheduler.ha import RouterHA
from tests.support.redis_server import RedisServer, lease_router

TTL, RENEW = 1.0, 0.2


def router(url: str, key: str = "narwhal:test") -> RouterHA:
    return lease_router(url, key=key, ttl=TTL, renew=RENEW)


async def renew_until(ha: RouterHA, mode: str, timeout_s: float) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while ha.lease_mode() != mode:
        if loop.time() - t0 > timeout_s:
            raise AssertionError(f"still {ha.lease_mode()} after {timeout_s} s: {ha.view()}")
        await ha.renew_once()
        await asyncio.sleep(RENEW)
    return loop.time() - t0


async def test_one_holder_and_takeover_within_ttl_plus_one_renewal(redis_server: RedisServer) -> None:
    a, b = router(redis_server.url), router(redis_server.url)
    try:
        await a.renew_once()
        await b.renew_once()
        assert a.lease_mode() == "active" and b.lease_mode() == "standby"
        assert a.lease is not None and b.lease is not None
        first = a.epoch()
        assert first >= 1 and b.epoch() == 0 and b.lease.holder == a.lease.holder_id
        await a.renew_once()
        await b.renew_once()
        assert a.epoch() == first and b.lease_mode() == "standby"  # renewals keep the epoch
        # a stops renewing (paused, partitioned): it fences itself before b can take over
        took = await renew_until(b, "active", TTL + RENEW + 1.0)
        assert took <= TTL + 2 * RENEW + 0.3
        assert a.lease_mode() == "fenced" and b.epoch() > first
        for _ in range(10):  # (a call that times out on a loaded machine changes nothing: until one is answered)
            await a.renew_once()
            if a.lease.last_error is None:
                break
        assert a.lease_mode() == "standby" and a.epoch() == 0  # answered: never back under its old epoch
    finally:
        await a.release()
        await b.release()


async def test_a_clean_stop_hands_the_lease_over_at_once(redis_server: RedisServer) -> None:
    a, b = router(redis_server.url), router(redis_server.url)
    await a.renew_once()
    await b.renew_once()
    assert a.lease_mode() == "active" and b.lease_mode() == "standby"
    await a.release()
    await b.renew_once()
    assert b.lease_mode() == "active"
    await b.release()


async def test_lost_redis_keeps_the_lease_until_it_lapses_then_fences_and_recovers(redis_server: RedisServer) -> None:
    a = router(redis_server.url)
    try:
        await a.renew_once()
        first = a.epoch()
        assert a.lease_mode() == "active"
        redis_server.stop()
        await a.renew_once()
        assert a.lease_mode() == "active" and a.lease is not None and a.lease.last_error  # still within its lease
        await asyncio.sleep(TTL)
        await a.renew_once()
        assert a.lease_mode() == "fenced" and a.view()["last_error"]
        redis_server.start()  # restarted empty: the epoch counter is gone
        await renew_until(a, "active", 5.0)
        assert a.epoch() > first  # never an epoch handed out before
    finally:
        await a.release()
