"""Differential review of the router lease against the real semantics of Redis and redis-py.

Each test here failed, before its fix, because of one defect; none tests behaviour that was
already right.  They run against a real
``redis-server`` on 127.0.0.1 (tests/support/redis_server.py), stopped by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import redis

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.scheduler.ha import RouterHA
from tests.support.redis_server import RedisServer, lease_router

TTL, RENEW = 1.0, 0.2
KEY = "narwhal:review"


def admin(server: RedisServer) -> "redis.Redis[bytes]":
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2, protocol=2)


def router(url: str, *, ttl: float = TTL, renew: float = RENEW, mono: Callable[[], float] = time.monotonic,
           key: str = KEY) -> RouterHA:
    return lease_router(url, key=key, ttl=ttl, renew=renew, mono=mono)


async def renew_until(ha: RouterHA, mode: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while ha.lease_mode() != mode:
        if time.monotonic() > end:
            raise AssertionError(f"still {ha.lease_mode()} after {timeout_s} s: {ha.view()}")
        await ha.renew_once()
        await asyncio.sleep(RENEW)


async def acquire(ha: RouterHA) -> None:
    """Until this router holds the lease (a backend may make the first taker wait a TTL)."""
    await renew_until(ha, "active", ha.cfg.ha.lease.ttl_s + 2.0)


async def close(*routers: RouterHA) -> None:
    for ha in routers:
        if ha.backend is not None:
            with contextlib.suppress(Exception):
                await ha.backend.close()
            ha.backend = None


# -- 1. a Redis that restarts empty hands the lease to a second router at once -----------------
async def test_redis_restarted_empty_gives_no_second_active_while_the_first_is_still_active(
        redis_server: RedisServer) -> None:
    """docs/operations.md: the active "stops admitting at ttl_s minus a 10 % margin — before Redis
    can give the lease to anyone else".  A Redis without persistence that restarts (SIGKILL, OOM
    kill, pod reschedule) comes back empty, and the script hands the lease to the first caller at
    once, while the old holder is still within its own lease: two actives (until the old one's
    next renewal, or until its lease lapses when it cannot reach Redis).  Redis' own answer is
    "delayed restarts" (redis.io distributed locks, "Performance, crash recovery and fsync")."""
    a, b = router(redis_server.url, ttl=2.0, renew=0.4), router(redis_server.url, ttl=2.0, renew=0.4)
    try:
        await acquire(a)
        await b.renew_once()
        assert a.lease_mode() == "active" and b.lease_mode() == "standby"
        redis_server.stop()
        redis_server.start()  # empty: --save "" --appendonly no
        for _ in range(3):  # (the first call after the restart may fail on b's stale pooled connection)
            await b.renew_once()
            if b.lease is not None and b.lease.last_error is None:
                break
        both = a.lease_mode() == "active" and b.lease_mode() == "active"
        assert not both, f"split brain: a {a.view()} / b {b.view()}"
    finally:
        await close(a, b)


# -- 2. epochs repeat after Redis loses its data --------------------------------------------------
async def test_epochs_never_repeat_after_redis_loses_its_data(redis_server: RedisServer) -> None:
    """docs/operations.md: "Epochs never repeat, even after Redis loses its data".  The floor is
    only the highest epoch the *calling* router has seen: a router process started after the
    epochs were handed out (a restarted standby, a rolling restart) has seen none, and after
    Redis loses its data INCR starts again at 1 — an epoch already used as a fencing token."""
    first = router(redis_server.url)
    await acquire(first)
    await first.release()  # handed over
    second = router(redis_server.url)
    await acquire(second)
    highest = second.epoch()
    assert highest >= 2
    await second.release()
    redis_server.stop()
    redis_server.start()  # lost its data
    fresh = router(redis_server.url)  # e.g. the standby, restarted meanwhile
    try:
        await renew_until(fresh, "active", TTL + 2.0)
        assert fresh.epoch() > highest, f"epoch {fresh.epoch()} was handed out before (highest {highest})"
    finally:
        await close(fresh)


# -- 3. a fenced router goes back to active under the epoch it was fenced in ---------------------
async def test_a_fenced_router_never_admits_again_under_that_epoch(redis_server: RedisServer) -> None:
    """docs/operations.md ("Fenced"): a router that could not renew in time "never admits again
    under that epoch" (also ha/lease.py).  But Redis keeps the key for the full TTL, longer than
    the router's own lease (10 % margin), and the script renews any key whose holder part is the
    caller's, whatever the epoch: a router paused past its own lease but not past Redis' TTL
    resumes, renews, and is active again under the epoch it was fenced in."""
    clock = [1000.0]
    a = router(redis_server.url, ttl=10.0, renew=2.0, mono=lambda: clock[0])
    try:
        await a.renew_once()
        if a.lease_mode() != "active":
            await asyncio.sleep(10.5)  # (a backend that makes the first taker wait a TTL)
            await a.renew_once()
        first = a.epoch()
        assert first >= 1
        clock[0] += 9.5  # paused (SIGSTOP, GC, VM steal): past its 9 s, Redis' 10 s not yet
        assert a.lease_mode() == "fenced"
        await a.renew_once()
        assert not (a.lease_mode() == "active" and a.epoch() == first), (
            f"active again under the fenced epoch {first}: {a.view()}")
    finally:
        await close(a)


# -- 4. a drain's release races the renewal in flight --------------------------------------------
async def test_drain_release_during_a_renewal_in_flight_hands_the_lease_over(redis_server: RedisServer) -> None:
    """docs/operations.md ("Stopping", "Failover"): a drain "gives up its router lease at once (the
    standby takes over now, not after the TTL)".  RouterHA.release() does not wait for, or
    disown, a renewal already in flight in the run loop: a renewal that reaches Redis after the
    release's DEL (network delay, a reconnect) finds no key and acquires a new epoch; renew_once
    applies the won answer, and since release() already dropped the backend, nothing releases it
    again: the standby waits a whole TTL."""
    a, b = router(redis_server.url, ttl=3.0, renew=0.5), router(redis_server.url, ttl=3.0, renew=0.5)
    try:
        await acquire(a)
        await b.renew_once()
        assert a.lease_mode() == "active" and b.lease_mode() == "standby"
        assert a.backend is not None
        real = a.backend._acquire

        async def delayed(**kw: object) -> object:  # the renewal's packets are late on the network
            await asyncio.sleep(0.2)
            return await real(**kw)

        a.backend._acquire = delayed  # type: ignore[assignment]
        in_flight = asyncio.get_running_loop().create_task(a.renew_once())
        await asyncio.sleep(0.05)
        a.give_up()  # SchedulerService.drain → give_up, then api "drain" → ha.release()
        await a.release()
        await in_flight
        await b.renew_once()
        holder = admin(redis_server).get(KEY)
        assert b.lease_mode() == "active", f"not handed over: key {holder!r}, a {a.view()}, b {b.view()}"
    finally:
        await close(a, b)


# -- 5. one dropped connection fences the active at the documented limit renew_s = ttl_s / 2 ------
async def test_one_dropped_connection_does_not_fence_the_active(redis_server: RedisServer) -> None:
    """config: ``renew_s`` ≤ ``ttl_s``/2, "two renewals per lease" (docs/configuration.md).  A
    client built by ``redis.asyncio.from_url`` gets ``Retry(NoBackoff(), 0)`` (redis-py
    asyncio/connection.py), so the first command on a pooled connection the server closed (Redis
    restart or failover, its ``timeout`` setting, CLIENT KILL, an idle-timeout proxy) fails with
    ConnectionError and is not retried: one renewal is lost.  With the 10 % margin, the next
    renewal comes after the router's own lease has run out: fenced (503 for everyone) on a
    single dropped connection."""
    try:
        a = router(redis_server.url, ttl=1.0, renew=0.5)  # accepted by the config today
    except ValueError:
        return  # the config no longer allows a renew_s that cannot survive one lost renewal
    try:
        await acquire(a)
        await a.renew_once()  # the last good renewal: its lease runs to now + 0.9 s
        admin(redis_server).client_kill_filter(_type="normal", skipme=True)  # closes a's pooled connection
        await asyncio.sleep(0.5)
        await a.renew_once()
        await asyncio.sleep(0.5)
        assert a.lease_mode() == "active", f"fenced after one dropped connection: {a.view()}"
    finally:
        await close(a)


# -- 6. redis-py 8 speaks RESP3 (HELLO): no Redis before 6.0 -------------------------------------
async def test_a_redis_without_hello_as_before_6_0_is_usable() -> None:
    """docs/operations.md and ha/redis_lease.py: "Any Redis ≥ 2.6 with Lua scripting".  redis-py
    8.1 (pinned) defaults to RESP3 (redis/utils.py DEFAULT_RESP_VERSION = 3) and sends ``HELLO 3``
    on every connect (asyncio/connection.py on_connect_check_health), with no fallback; Redis
    before 6.0 has no HELLO ("unknown command"), so no router ever gets the lease.  Emulated here
    on 6.2 by renaming HELLO away."""
    server = RedisServer(extra=["--rename-command", "HELLO", ""]).start()
    a = router(server.url)
    try:
        await acquire(a)
    finally:
        await close(a)
        server.stop()


# -- 7. after a failover the pooled connection to the demoted master never recovers -------------
class Proxy:
    """A TCP forwarder standing for a virtual IP / DNS name: new connections go to ``target``;
    connections already open stay with the server they were opened to."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server: asyncio.base_events.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [w, uw]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        for t in (pipe(r, uw), pipe(ur, w)):
            task = asyncio.get_running_loop().create_task(t)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in self.writers:
            with contextlib.suppress(Exception):
                w.close()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def wait_for(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


async def test_after_a_failover_the_demoted_masters_connection_is_dropped() -> None:
    """docs/operations.md recommends "a replicated Redis with a failover".  After a failover the
    old master, when it is still up (a partition, or it rejoins), is demoted to a replica; the
    router's pooled connection still goes to it and every renewal gets READONLY — a reply, not a
    connection error, so redis-py's plain client keeps the connection (only its Sentinel
    connection turns READONLY into a disconnect: redis/asyncio/sentinel.py
    SentinelManagedConnection.read_response).  The router never reaches the new master behind
    the same address: fenced for good, though the new master is up and holds its lease."""
    m, r = RedisServer().start(), RedisServer().start()
    proxy = Proxy(m.port)
    a: RouterHA | None = None
    try:
        admin(r).replicaof("127.0.0.1", m.port)
        wait_for(lambda: admin(r).info("replication").get("master_link_status") == "up")
        url = f"redis://127.0.0.1:{await proxy.start()}/0"
        a = router(url, ttl=2.0, renew=0.4)
        await acquire(a)
        wait_for(lambda: admin(r).get(KEY) is not None)
        # failover: the replica is promoted, the old master demoted, the address moves
        admin(r).replicaof("NO", "ONE")
        admin(m).replicaof("127.0.0.1", r.port)
        proxy.target = r.port
        for _ in range(3):
            await a.renew_once()
            await asyncio.sleep(0.1)
        assert a.lease.last_error is None and a.lease_mode() == "active", f"stuck on the old master: {a.view()}"
    finally:
        if a is not None:
            await close(a)
        await proxy.stop()
        m.stop()
        r.stop()


# -- 8. an evicting Redis drops the lease key while its holder is active -------------------------
async def test_an_evicting_redis_gives_no_second_active() -> None:
    """docs/operations.md: run the lease "where the Ray cluster already runs its
    GCS-fault-tolerance Redis" — any Redis ≥ 2.6.  A Redis with a ``maxmemory`` and an eviction
    policy (volatile-*, allkeys-*; redis.io "Key eviction") evicts keys before their TTL; the
    lease key is a volatile key with the shortest TTL, the first one volatile-ttl takes.  The
    lease never checks the policy: the standby takes a lease its holder still believes it has."""
    server = RedisServer(extra=["--maxmemory-policy", "volatile-ttl", "--maxmemory-samples", "64"]).start()
    a, b = router(server.url), router(server.url)
    try:
        with contextlib.suppress(AssertionError):
            await acquire(a)
        if a.lease_mode() != "active":
            return  # the lease refuses a Redis that may evict its keys
        await b.renew_once()
        assert b.lease_mode() == "standby"
        c = admin(server)
        for i in range(8):  # another application's cache entries, with long TTLs
            c.set(f"cache:{i}", b"x" * 100_000, ex=3600)
        used = int(c.info("memory")["used_memory"])
        c.config_set("maxmemory", used + 50_000)
        c.set("cache:big", b"y" * 80_000)  # over the limit: the next command evicts
        await b.renew_once()
        both = a.lease_mode() == "active" and b.lease_mode() == "active"
        assert not both, f"split brain after eviction: a {a.view()} / b {b.view()}"
    finally:
        await close(a, b)
        server.stop()


# -- 9. a malformed URL ends the HA loop for good, silently -------------------------------------
async def test_a_bad_lease_url_is_refused_or_reported_not_a_dead_loop() -> None:
    """``ha.lease.url`` is only checked for being non-empty; ``redis.asyncio.from_url`` raises
    ValueError for a URL without redis://, rediss:// or unix:// (redis/asyncio/connection.py
    parse_url).  RouterHA.run builds the client outside any try: the task dies on its first
    line, unobserved (SchedulerService.start keeps it in ``_ha``), and the router stays
    ``standby`` forever with ``last_error`` None."""
    url = "127.0.0.1:6379"  # a plausible typo: no scheme
    try:
        cfg = NarwhalConfig.model_validate(
            {"ha": {"lease": {"backend": "redis", "url": url, "key": KEY, "ttl_s": TTL, "renew_s": RENEW}}})
    except ValueError:
        return  # refused at configuration time
    ha = RouterHA(cfg)
    task = asyncio.get_running_loop().create_task(ha.run(lambda: None))
    await asyncio.sleep(2 * RENEW)
    try:
        assert not task.done(), f"the HA loop ended: {task.exception() if task.done() else None!r}"
        assert ha.lease is not None and ha.lease.last_error, "nothing says why there is no lease"
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await close(ha)
