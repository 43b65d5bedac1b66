"""The scheduler's KV-event feeds: one subscriber task per engine configured with ``kv_events``,
each applying its engine's events to that engine's prefix index (:mod:`narwhal_serve.kvevents`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from narwhal_serve.config import PlacementConfig
from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.subscriber import KVEventSubscriber
from narwhal_serve.placement.engines import EngineState

log = logging.getLogger("narwhal.kvevents")

# engine blocks one index remembers at most (vLLM's BlockRemoved normally keeps it at the engine's KV
# capacity; this bounds a stream that never removes)
MAX_ENGINE_BLOCKS = 1 << 20


def _block_size_of(e: EngineState) -> Callable[[int], None]:
    def learned(block_tokens: int) -> None:
        e.cache_block_tokens = block_tokens

    return learned


def exact_index(e: EngineState, placement: PlacementConfig) -> KVEventIndex:
    """The index the engine's own KV events keep: its prefix set is then exact (no credit learned)."""
    e.prefix.clear()
    e.prefix_exact = True
    e.prefix_credit = 1.0
    return KVEventIndex(placement.prefix_block_tokens, MAX_ENGINE_BLOCKS, e.prefix, on_block_size=_block_size_of(e))


class KVEventFeeds:
    def __init__(self, placement: PlacementConfig) -> None:
        self.placement = placement
        self.subs: dict[str, KVEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, engines: Iterable[EngineState]) -> None:
        for e in engines:
            ev = e.cfg.kv_events
            if ev is None or e.cfg.name in self._tasks or not self.placement.prefix_aware:
                continue
            index = exact_index(e, self.placement)
            sub = KVEventSubscriber(e.cfg.name, ev.endpoint, ev.replay_endpoint, ev.topic, index)
            self.subs[e.cfg.name] = sub
            task = asyncio.get_running_loop().create_task(self._run(sub), name=f"kv-events-{e.cfg.name}")
            self._tasks[e.cfg.name] = task

    async def _run(self, sub: KVEventSubscriber) -> None:
        while True:  # a subscriber that fails (a bug, a bad endpoint) is restarted, never silently gone
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv events of %s: subscriber failed; restarting in 1 s", sub.engine)
                sub.state = "restarting"
                await asyncio.sleep(1.0)

    def restart(self, e: EngineState) -> None:
        """The engine's process changed (a managed engine's new replica): follow its new sockets."""
        self.drop(e.cfg.name)
        if e.cfg.kv_events is None:
            e.prefix_exact = False
            return
        self.start([e])

    def drop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        self.subs.pop(name, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def view(self, name: str) -> dict[str, Any] | None:
        sub = self.subs.get(name)
        return None if sub is None else sub.view()
