"""The scheduler's KV-event feeds: each engine configured with ``kv_events`` has its prefix index kept
by its own events (:mod:`narwhal_serve.kvevents`) — by a subscriber task in this process
(:class:`KVEventFeeds`), or, with ``placement.kv_event_shards``, by the shard that follows it, whose
changes this process takes and applies (:class:`ShardedKVFeeds`; docs/operations.md, "KV-event shards")."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from narwhal_serve.config import PlacementConfig
from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.shard import MAX_ENGINE_BLOCKS, TAKE_WAIT_S, ShardLink, Taken, apply_delta
from narwhal_serve.kvevents.subscriber import RESTART_S, KVEventSubscriber, follow_forever
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.prefix import CREDIT_PRIOR

log = logging.getLogger("narwhal.kvevents")

UNPEND_GRACE_S = 1.0  # a done request's blocks its engine's events have not named stay pending at most this long


def _block_size_of(e: EngineState) -> Callable[[int], None]:
    def learned(block_tokens: int) -> None:
        e.cache_block_tokens = block_tokens

    return learned


def _exact(e: EngineState) -> None:
    """From now on the engine's prefix set is what its KV events say (no credit learned)."""
    e.prefix.clear()
    e.prefix_exact = True
    e.prefix_credit = 1.0


class _Touching:
    """The engine's prefix set as an index's target, telling the scheduler of each change."""

    def __init__(self, e: EngineState, touch: Callable[[str], None]) -> None:
        self.prefix, self.name, self.touch = e.prefix, e.cfg.name, touch

    def insert(self, hashes: list[int]) -> None:
        self.prefix.insert(hashes)
        self.touch(self.name)

    def remove(self, hashes: Iterable[int]) -> None:
        self.prefix.remove(hashes)
        self.touch(self.name)

    def clear(self) -> None:
        self.prefix.clear()
        self.touch(self.name)


def _untouched(name: str) -> None:
    pass


def exact_index(e: EngineState, placement: PlacementConfig, touch: Callable[[str], None] = _untouched) -> KVEventIndex:
    """The index the engine's own KV events keep: its prefix set is then exact (no credit learned);
    ``touch``: told the engine's name on each change (SchedulerState.touch)."""
    _exact(e)
    touch(e.cfg.name)
    return KVEventIndex(placement.prefix_block_tokens, MAX_ENGINE_BLOCKS, _Touching(e, touch),
                        on_block_size=_block_size_of(e), max_blocks=placement.prefix_max_blocks)


def _followed(e: EngineState, placement: PlacementConfig) -> bool:
    return e.cfg.kv_events is not None and placement.prefix_aware


async def _cancelled(tasks: Iterable[asyncio.Task[None]]) -> None:
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


class _Feeds:
    """What both kinds of feed do alike."""

    def start(self, engines: Iterable[EngineState]) -> None:
        raise NotImplementedError

    def drop(self, name: str) -> None:
        raise NotImplementedError

    def restart(self, e: EngineState) -> None:
        """The engine's process changed (a managed engine's new replica): follow its new sockets."""
        self.drop(e.cfg.name)
        if e.cfg.kv_events is None:
            e.prefix_exact = False
            e.prefix.clear()
            e.prefix_credit = CREDIT_PRIOR  # (learned again, as for any engine without events)
            return
        self.start([e])


class KVEventFeeds(_Feeds):
    """One subscriber task per engine, in this process."""

    def __init__(self, placement: PlacementConfig, touch: Callable[[str], None] = _untouched) -> None:
        self.placement = placement
        self.touch = touch
        self.subs: dict[str, KVEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, engines: Iterable[EngineState]) -> None:
        for e in engines:
            ev = e.cfg.kv_events
            if ev is None or e.cfg.name in self._tasks or not self.placement.prefix_aware:
                continue
            index = exact_index(e, self.placement, self.touch)
            sub = KVEventSubscriber(e.cfg.name, ev.endpoint, ev.replay_endpoint, ev.topic, index)
            self.subs[e.cfg.name] = sub
            task = asyncio.get_running_loop().create_task(follow_forever(sub), name=f"kv-events-{e.cfg.name}")
            self._tasks[e.cfg.name] = task

    def drop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        self.subs.pop(name, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await _cancelled(tasks)

    def view(self, name: str) -> dict[str, Any] | None:
        sub = self.subs.get(name)
        return None if sub is None else sub.view()

    def unpend(self, e: EngineState, blocks: Iterable[int]) -> bool:
        """(The engine's events are applied as they come: its request's blocks leave pending now.)"""
        return False


class ShardedKVFeeds(_Feeds):
    """The engines' KV events followed by shards (:mod:`narwhal_serve.kvevents.shard`): per shard one
    task sends it what to follow or drop, in order, and one takes its changes (a long poll) and
    applies them to the engines' prefix sets.  A shard that restarted (a new incarnation), or one a
    call failed on, has all its engines followed again under new generations, their sets cleared."""

    def __init__(self, placement: PlacementConfig, links: Sequence[ShardLink],
                 clock: Callable[[], float] = time.monotonic, touch: Callable[[str], None] = _untouched) -> None:
        self.placement = placement
        self.touch = touch
        self.links = list(links)
        self.clock = clock
        self._unpend: dict[str, list[tuple[float, tuple[int, ...]]]] = {}  # blocks to leave pending: when, which
        self.followed: dict[str, tuple[int, int, EngineState]] = {}  # name → (shard, generation, engine)
        self.load = [0] * len(self.links)  # engines each shard follows
        # generations unique across scheduler processes: shards outlive a scheduler replica's
        # restart with the old one's feeds, whose generations must never match a new one's
        self._gens = itertools.count(time.time_ns())
        self._dropping: list[set[str]] = [set() for _ in self.links]  # stray feeds a drop was sent for
        self._incarnation: list[str | None] = [None] * len(self.links)
        self._lost = [False] * len(self.links)  # a call failed: follow everything again when it answers
        self._views: dict[str, dict[str, Any]] = {}
        self._commands: list[asyncio.Queue[tuple[str, ...]]] = []
        self._tasks: list[asyncio.Task[None]] = []

    def _ensure_tasks(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        for i in range(len(self.links)):
            self._commands.append(asyncio.Queue())
            self._tasks.append(loop.create_task(self._send(i), name=f"kv-shard-{i}-commands"))
            self._tasks.append(loop.create_task(self._take(i), name=f"kv-shard-{i}-take"))

    def start(self, engines: Iterable[EngineState]) -> None:
        self._ensure_tasks()
        for e in engines:
            if _followed(e, self.placement) and e.cfg.name not in self.followed:
                self._follow(e)

    def _follow(self, e: EngineState) -> None:
        """Follow ``e`` under a new generation: on its shard when it has one, else on the one
        following the fewest engines."""
        ev = e.cfg.kv_events
        assert ev is not None
        got = self.followed.get(e.cfg.name)
        if got is None:
            i = min(range(len(self.links)), key=self.load.__getitem__)
            self.load[i] += 1
        else:
            i = got[0]
        gen = next(self._gens)
        _exact(e)
        self.touch(e.cfg.name)
        self.followed[e.cfg.name] = (i, gen, e)
        self._commands[i].put_nowait(("follow", e.cfg.name, str(gen), ev.endpoint, ev.replay_endpoint or "", ev.topic))

    def drop(self, name: str) -> None:
        got = self.followed.pop(name, None)
        self._views.pop(name, None)
        if got is not None:
            self._settle(got[2], None)
            self.load[got[0]] -= 1
            self._commands[got[0]].put_nowait(("drop", name))

    def _seen(self, i: int, incarnation: str) -> None:
        """A shard answered as ``incarnation``: when it restarted or was lost, follow its engines again."""
        was = self._incarnation[i]
        self._incarnation[i] = incarnation
        if was is None or (was == incarnation and not self._lost[i]):
            return
        self._lost[i] = False
        log.warning("kv-event shard %d %s: following its engines again", i, "restarted" if was != incarnation else "answers again")
        for _, e in [(n, e) for n, (s, _, e) in self.followed.items() if s == i]:
            self._follow(e)

    async def _send(self, i: int) -> None:
        link, queue = self.links[i], self._commands[i]
        while True:
            cmd = await queue.get()
            try:
                if cmd[0] == "follow":
                    _, name, gen, endpoint, replay, topic = cmd
                    incarnation = await link.follow(name, int(gen), endpoint, replay or None, topic)
                else:
                    incarnation = await link.drop(cmd[1])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv-event shard %d: %s %s failed", i, cmd[0], cmd[1])
                self._lost[i] = True
                continue
            finally:
                if cmd[0] == "drop":  # (answered or failed: sent again if the shard still reports it)
                    self._dropping[i].discard(cmd[1])
            self._seen(i, incarnation)

    async def _take(self, i: int) -> None:
        link = self.links[i]
        while True:
            try:
                taken = await link.take(TAKE_WAIT_S)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv-event shard %d: take failed; again in %g s", i, RESTART_S)
                self._lost[i] = True
                self._settle_due()  # (blocks due leave pending whether or not a shard answers)
                await asyncio.sleep(RESTART_S)
                continue
            self.taken(i, taken)
            self._settle_due()

    def _settle_due(self) -> None:
        if self._unpend:
            now = self.clock()
            for name in [n for n, waits in self._unpend.items() if waits[0][0] <= now]:
                if name in self.followed:
                    self._settle(self.followed[name][2], now)
                else:
                    self._unpend.pop(name, None)

    def unpend(self, e: EngineState, blocks: Iterable[int]) -> bool:
        """A request's prefill on ``e`` is done: its blocks the engine's events have named leave
        pending now, the others once the engine's next changes are applied (its events for them are
        on their way through the shard; without this they would be neither pending nor held for a
        take's round trip), or after UNPEND_GRACE_S (the engine did not keep them)."""
        if e.cfg.name not in self.followed:
            return False
        later = e.prefix.unpend_stored(blocks)
        if later:
            self._unpend.setdefault(e.cfg.name, []).append((self.clock() + UNPEND_GRACE_S, later))
        return True

    def _settle(self, e: EngineState, before: float | None) -> None:
        """The blocks waiting to leave ``e``'s pending set: all of them, or those due ``before``."""
        self.touch(e.cfg.name)
        waits = self._unpend.pop(e.cfg.name, [])
        keep = []
        for due, blocks in waits:
            if before is None or due <= before:
                e.prefix.unpend(blocks)
            else:
                keep.append((due, blocks))
        if keep:
            self._unpend[e.cfg.name] = keep

    def taken(self, i: int, taken: Taken) -> None:
        """A shard's changes applied to the engines it follows for us (older generations dropped)."""
        self._seen(i, taken.shard)
        for name, d in taken.deltas.items():
            got = self.followed.get(name)
            if got is None or got[0] != i:  # a feed this shard should not have (a drop that failed, an
                self._stray(i, name)        # old scheduler's): dropped again, its changes ignored
                continue
            if got[1] != d.gen:
                continue
            e = got[2]
            self.touch(name)
            apply_delta(e.prefix, d)
            if d.block_size is not None:
                e.cache_block_tokens = d.block_size
            if name in self._unpend:
                self._settle(e, None)
        if taken.views is not None:
            for name, v in taken.views.items():
                got = self.followed.get(name)
                if got is not None and got[0] == i:
                    self._views[name] = {"shard": i, **v}
                else:
                    self._stray(i, name)

    def _stray(self, i: int, name: str) -> None:
        if name not in self._dropping[i]:
            self._dropping[i].add(name)
            self._commands[i].put_nowait(("drop", name))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await _cancelled(tasks)

    def view(self, name: str) -> dict[str, Any] | None:
        got = self.followed.get(name)
        if got is None:
            return None
        return self._views.get(name, {"shard": got[0], "state": "connecting"})
