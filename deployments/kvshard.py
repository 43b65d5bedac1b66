"""KV-event shard deployments (``placement.kv_event_shards``; docs/operations.md, "KV-event shards"):
one replica each, following the engines the scheduler gives it; and the scheduler's link to one."""

from __future__ import annotations

from typing import Any

from ray.serve.handle import DeploymentHandle

from deployments.logs import to_serve_log
from narwhal_serve.kvevents.shard import KVShard, Taken


class KVEventShard(KVShard):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        to_serve_log()
        super().__init__(*args, **kwargs)

    async def __del__(self) -> None:
        await self.stop()


class HandleLink:
    """A shard reached through its deployment's handle (:class:`~narwhal_serve.kvevents.shard.ShardLink`)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def follow(self, engine: str, gen: int, endpoint: str, replay_endpoint: str | None, topic: str) -> str:
        out: str = await self.handle.follow.remote(engine, gen, endpoint, replay_endpoint, topic)
        return out

    async def drop(self, engine: str) -> str:
        out: str = await self.handle.drop.remote(engine)
        return out

    async def take(self, wait_s: float) -> Taken:
        out: Taken = await self.handle.take.remote(wait_s)
        return out
