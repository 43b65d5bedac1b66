"""KV-event index shards: the engines' KV events applied outside the scheduler's process.

At Mooncake-length prompts (12 k tokens) a request's KV events store and remove 500–600 engine
blocks; applying them (following parents, hashing token blocks into the router's keys) costs about
2 ms a request, whatever the fleet's size (docs/performance.md, "Scale: what one scheduler holds").
Each engine's index is independent of every other's, so a shard owns a slice of the engines (the
scheduler gives a new engine to the shard following the fewest): it subscribes to their events and keeps their :class:`KVEventIndex`, whose target
records the router blocks added and removed since the scheduler last took them
(:class:`DeltaTarget`).  The scheduler takes each shard's changes in a long poll (:meth:`KVShard.take`)
and applies them to the engines' prefix sets (:func:`apply_delta`): a few hundred set operations a
request instead of the events' hashing.  Decisions stay in one place: a shard only says which blocks
each engine holds.

Generations: the scheduler gives each follow of an engine a number (a new one when the engine's
process changes, or the shard restarts); a shard's changes carry it, and changes of an older follow
are dropped.  A shard's ``incarnation`` (random, per process) tells the scheduler that the shard
restarted and has forgotten what it followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.subscriber import KVEventSubscriber, follow_forever
from narwhal_serve.placement.prefix import PrefixIndex

TAKE_WAIT_S = 1.0  # a long poll answers empty after this long without a change
VIEWS_EVERY_S = 1.0  # the subscribers' states (the scheduler's /status) ride on a take at most this often
# engine blocks one index remembers at most (vLLM's BlockRemoved normally keeps it at the engine's KV
# capacity; this bounds a stream that never removes)
MAX_ENGINE_BLOCKS = 1 << 20


@dataclass(slots=True)
class PrefixDelta:
    """One engine's router blocks added and removed since the last take (disjoint)."""

    gen: int
    cleared: bool = False  # everything before was forgotten (applied first)
    removed: tuple[int, ...] = ()
    added: tuple[int, ...] = ()  # in the order they were stored, the most recent last
    block_size: int | None = None  # the engine's KV block size, when learned since


def apply_delta(prefix: PrefixIndex, d: PrefixDelta) -> None:
    """``d`` applied to the engine's prefix set: the same set the index's own target would hold,
    up to which blocks the set's bound evicts."""
    if d.cleared:
        prefix.clear()
    if d.removed:
        prefix.remove(d.removed)
    if d.added:
        prefix.insert(d.added)


class DeltaTarget:
    """A :class:`~narwhal_serve.kvevents.index.Target` that records changes instead of holding blocks."""

    __slots__ = ("cleared", "added", "removed", "block_size", "_notify")

    def __init__(self, notify: Callable[[], None]) -> None:
        self.cleared = False
        self.added: dict[int, None] = {}
        self.removed: set[int] = set()
        self.block_size: int | None = None
        self._notify = notify

    def insert(self, hashes: list[int]) -> None:
        added, removed = self.added, self.removed
        for h in hashes:
            removed.discard(h)
            added.pop(h, None)  # stored again: the most recent
            added[h] = None
        self._notify()

    def remove(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.added.pop(h, None)
            self.removed.add(h)  # the scheduler may hold it from an earlier take
        self._notify()

    def clear(self) -> None:
        self.cleared = True
        self.added.clear()
        self.removed.clear()
        self._notify()

    def learned(self, block_size: int) -> None:
        self.block_size = block_size
        self._notify()

    def dirty(self) -> bool:
        return self.cleared or bool(self.added) or bool(self.removed) or self.block_size is not None

    def drain(self, gen: int) -> PrefixDelta:
        d = PrefixDelta(gen, self.cleared, tuple(self.removed), tuple(self.added), self.block_size)
        self.cleared, self.block_size = False, None
        self.added, self.removed = {}, set()
        return d


@dataclass(slots=True)
class Taken:
    """A take's answer: the shard's incarnation, its engines' changes, and now and then the
    subscribers' states."""

    shard: str
    deltas: dict[str, PrefixDelta] = field(default_factory=dict)
    views: dict[str, dict[str, Any]] | None = None


class ShardLink(Protocol):
    """How the scheduler reaches a shard (in process, or a Serve deployment's handle)."""

    async def follow(self, engine: str, gen: int, endpoint: str, replay_endpoint: str | None, topic: str) -> str: ...
    async def drop(self, engine: str) -> str: ...
    async def take(self, wait_s: float) -> Taken: ...


@dataclass
class _Feed:
    gen: int
    index: KVEventIndex
    target: DeltaTarget
    sub: KVEventSubscriber | None = None
    task: asyncio.Task[None] | None = None


class KVShard:
    """One shard: its engines' subscriptions and indexes, and the changes not taken yet."""

    def __init__(self, router_block_tokens: int, capacity: int = MAX_ENGINE_BLOCKS,
                 max_blocks: int | None = None) -> None:
        self.router_block_tokens = router_block_tokens
        self.capacity = capacity
        self.max_blocks = max_blocks  # placement.prefix_max_blocks (KVEventIndex)
        self.incarnation = secrets.token_hex(8)
        self.feeds: dict[str, _Feed] = {}
        self._changed = asyncio.Event()
        self._views_at = 0.0

    def _subscribe(self, feed: _Feed, engine: str, endpoint: str, replay_endpoint: str | None, topic: str) -> None:
        """Start feeding ``feed.index`` (here: a ZMQ subscriber task; the replay feeds it directly)."""
        feed.sub = KVEventSubscriber(engine, endpoint, replay_endpoint, topic, feed.index)
        feed.task = asyncio.get_running_loop().create_task(follow_forever(feed.sub), name=f"kv-events-{engine}")

    async def follow(self, engine: str, gen: int, endpoint: str, replay_endpoint: str | None, topic: str) -> str:
        await self.drop(engine)
        target = DeltaTarget(self._changed.set)
        feed = _Feed(gen, KVEventIndex(self.router_block_tokens, self.capacity, target, on_block_size=target.learned,
                                       max_blocks=self.max_blocks),
                     target)
        self.feeds[engine] = feed
        self._subscribe(feed, engine, endpoint, replay_endpoint, topic)
        return self.incarnation

    async def drop(self, engine: str) -> str:
        feed = self.feeds.pop(engine, None)
        if feed is not None and feed.task is not None:
            feed.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feed.task
        return self.incarnation

    async def take(self, wait_s: float = TAKE_WAIT_S) -> Taken:
        """The changes since the last take, waiting up to ``wait_s`` for the first.  No other
        batching: what changes while an answer is on its way rides on the next (a take's round
        trip batches more the busier the shard is, and adds no wait when it is not)."""
        if not self._changed.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._changed.wait()
        return self.drain()

    def drain(self) -> Taken:
        self._changed.clear()
        out = Taken(self.incarnation, {name: f.target.drain(f.gen) for name, f in self.feeds.items() if f.target.dirty()})
        now = time.monotonic()
        if now - self._views_at >= VIEWS_EVERY_S:
            self._views_at = now
            out.views = {name: f.sub.view() if f.sub is not None else f.index.view() for name, f in self.feeds.items()}
        return out

    async def stop(self) -> None:
        for name in list(self.feeds):
            await self.drop(name)
