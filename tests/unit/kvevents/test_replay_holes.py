"""Replays that come back short, and sequences begun before the router heard them (found by a
read-only review of the KV-event path; each failed before its fix).  vLLM's replay socket drops what
its send queue cannot hold (the end marker too) and the time limits cut a slow replay: a hole in a
replay resynced — cleared — the whole index though the engine still held it all.  A restarted
publisher's first batches, sent before the router's subscription reconnected, and a start-up
replay that brought nothing, left their blocks unknown for good.  The replay socket is replaced by
the engine's buffer here (what its real protocol carries is tested in test_kv_events.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.subscriber import KVEventSubscriber
from narwhal_serve.kvevents.wire import BlockStored, KVEventBatch
from tests.support.kvindex import Held


def stored(i: int, ts: float | None = None) -> KVEventBatch:
    """Batch ``i``: one 64-token prompt of its own (one router block)."""
    return KVEventBatch(time.time() if ts is None else ts, [BlockStored(
        [f"{i}-{k}".encode() for k in range(4)], None, list(range(i * 64, i * 64 + 64)), 16, None, "GPU", None)])


class Engine:
    """The engine's replay buffer; ``lose``: what each replay asked for drops (a list per call)."""

    def __init__(self, buffer: dict[int, KVEventBatch], lose: list[set[int]] | None = None) -> None:
        self.buffer, self.lose, self.asked = buffer, lose or [], []

    async def replay(self, start: int) -> AsyncGenerator[tuple[int, KVEventBatch], None]:
        lost = self.lose[len(self.asked)] if len(self.asked) < len(self.lose) else set()
        self.asked.append(start)
        for s, b in sorted(self.buffer.items()):
            if s >= start and s not in lost:
                yield s, b


def subscriber(engine: Engine) -> tuple[KVEventSubscriber, KVEventIndex, Held]:
    held = Held()
    idx = KVEventIndex(64, 1 << 20, held)
    sub = KVEventSubscriber("e0", "ipc:///unused", "ipc:///unused-replay", "", idx)
    sub._replay = engine.replay  # type: ignore[method-assign]
    return sub, idx, held


async def test_a_replay_with_a_hole_is_asked_again_from_the_hole() -> None:
    batches = {s: stored(s) for s in range(21)}
    eng = Engine(batches, lose=[{14}])
    sub, idx, held = subscriber(eng)
    for s in range(10):
        idx.offer(s, batches[s])
    assert idx.offer(20, batches[20]) == "gap"
    await sub._fill(20, batches[20])
    assert eng.asked == [10, 14]
    assert idx.stats["resyncs"] == 0 and idx.last_seq == 20 and len(held.held) == 21


async def test_a_gap_the_engine_can_no_longer_replay_is_resynced() -> None:
    batches = {s: stored(s) for s in range(21)}
    eng = Engine({s: b for s, b in batches.items() if s >= 15})  # its buffer moved past 10..14
    sub, idx, held = subscriber(eng)
    for s in range(10):
        idx.offer(s, batches[s])
    assert idx.offer(20, batches[20]) == "gap"
    await sub._fill(20, batches[20])
    assert idx.stats["resyncs"] == 1 and idx.last_seq == 20 and len(held.held) == 1
    # a replay that never gets past a batch it keeps losing: bounded, then resynced
    eng = Engine(batches, lose=[{12}] * 10)
    sub, idx, held = subscriber(eng)
    for s in range(10):
        idx.offer(s, batches[s])
    idx.offer(20, batches[20])
    await sub._fill(20, batches[20])
    assert eng.asked == [10, 12] and idx.stats["resyncs"] == 1 and idx.last_seq == 20


async def test_a_sequence_begun_before_the_router_heard_it_is_replayed_from_its_start() -> None:
    """What run() does with a live batch of a sequence it has not followed from its start."""
    old = {s: stored(100 + s, ts=1.0 + s) for s in range(8)}
    new = {s: stored(s, ts=100.0 + s) for s in range(4)}  # the engine restarted: seq 0.. again
    eng = Engine(new)
    sub, idx, held = subscriber(eng)
    for s, b in old.items():
        idx.offer(s, b)
    assert idx.classify(3, new[3]) == "restart"
    await sub._live(3, new[3])
    assert eng.asked == [0] and idx.last_seq == 3 and idx.stats["restarts"] == 1
    assert len(held.held) == 4  # the new sequence's 0..3, none of the old
    # at start-up, a replay that brought nothing: the first live batch asks from 0 again
    eng = Engine({s: stored(s) for s in range(6)})
    sub, idx, held = subscriber(eng)
    await sub._live(5, eng.buffer[5])
    assert eng.asked == [0] and idx.last_seq == 5 and len(held.held) == 6


async def test_a_replay_is_applied_as_it_arrives() -> None:
    """Each replayed batch is applied before the next is decoded: the whole replay was held decoded
    at once before (vLLM buffers 10,000 batches; at long prompts, gigabytes of token IDs)."""
    sub, idx, held = subscriber(Engine({}))
    seen: list[int | None] = []

    async def replay(start: int) -> AsyncGenerator[tuple[int, KVEventBatch], None]:
        for s in range(start, 5):
            seen.append(idx.last_seq)
            yield s, stored(s)

    assert await sub._offer_all(replay(0)) == 0
    assert seen == [None, 0, 1, 2, 3] and idx.last_seq == 4 and len(held.held) == 5
