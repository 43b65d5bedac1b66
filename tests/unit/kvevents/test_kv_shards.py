"""KV-event shards (narwhal_serve/kvevents/shard.py, scheduler/kvfeeds.py ShardedKVFeeds): a shard's
changes, taken at any moment and applied, leave the scheduler's prefix sets exactly as applying the
events in its own process would (same blocks, same recency order); older generations are dropped; and
through the router, with two shards answering across a pickled hop, an engine's set follows its
cache, a restarted shard is followed again, and a shard that fails its calls is recovered."""

from __future__ import annotations

import asyncio
import pickle
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.shard import DeltaTarget, KVShard, PrefixDelta, Taken, apply_delta
from narwhal_serve.kvevents.wire import AllBlocksCleared, BlockRemoved, KVEventBatch
from narwhal_serve.placement.prefix import PrefixIndex, id_block_hashes
from narwhal_serve.scheduler.kvfeeds import KVEventFeeds, ShardedKVFeeds
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.sim.tokenizer import SimTokenizer
from tests.support.local_router import LocalRouter, start_local_router
from tests.unit.kvevents.test_kv_events import batch, chain, endpoints, eventually, stored


def _events(rng: random.Random, bs: int, steps: int) -> list[KVEventBatch]:
    """Prompts sharing prefixes stored (from the start, or continuing one), engine blocks removed,
    now and then everything cleared: what an engine under load publishes."""
    docs = [[rng.randrange(5) for _ in range(4 * bs)] + [rng.randrange(1000) for _ in range(rng.randrange(2, 8) * bs)]
            for _ in range(12)]
    held: list[int] = []
    out = []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.7:
            ids = rng.choice(docs)
            h = chain(ids, bs)
            cut = rng.randrange(1, len(h) + 1)
            if rng.random() < 0.5 and cut > 1:  # the continuation of a prefix stored before
                start = rng.randrange(1, cut)
                ev = stored(h[start:cut], h[start - 1], ids[start * bs:cut * bs], bs)
            else:
                ev = stored(h[:cut], None, ids[:cut * bs], bs)
            held += h[:cut]
            out.append(batch(ev))
        elif roll < 0.98 and held:
            out.append(batch(BlockRemoved(rng.sample(held, min(len(held), rng.randrange(1, 6))), "GPU")))
        else:
            out.append(batch(AllBlocksCleared()))
    return out


@pytest.mark.parametrize("engine_bs,router_bs", [(16, 32), (16, 16), (32, 16)])
@pytest.mark.parametrize("seed", range(4))
def test_changes_taken_at_any_moment_rebuild_the_same_set_in_the_same_order(engine_bs: int, router_bs: int, seed: int) -> None:
    rng = random.Random(seed)
    here = PrefixIndex(1_000_000)
    direct = KVEventIndex(router_bs, 10_000, here)
    notified = []
    target = DeltaTarget(lambda: notified.append(1))
    sharded = KVEventIndex(router_bs, 10_000, target, on_block_size=target.learned)
    there = PrefixIndex(1_000_000)
    small = PrefixIndex(12)
    block_sizes = []
    takes = peak = 0
    for seq, b in enumerate(_events(rng, engine_bs, 400)):
        direct.offer(seq, b)
        sharded.offer(seq, b)
        peak = max(peak, len(here))
        if rng.random() < 0.3:
            d = pickle.loads(pickle.dumps(target.drain(7)))  # it crosses a Ray hop
            assert d.gen == 7 and not (set(d.added) & set(d.removed))
            for s in (there, small):
                apply_delta(s, d)
            if d.block_size is not None:
                block_sizes.append(d.block_size)
            takes += 1
            assert list(there.held()) == list(here.held())  # the same blocks, the least recent first
            assert set(small.held()) <= set(here.held()) and len(small) <= 12
    assert takes > 50 and notified and block_sizes == [engine_bs]  # learned once, told once
    assert peak > 12  # the bound was reached: the small set only ever held what the engine held


def test_engines_are_spread_evenly_and_keep_their_shard_when_followed_again() -> None:
    engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:{i + 1}", "kv_events": {"endpoint": f"tcp://127.0.0.1:{i + 1}"}}
               for i in range(1000)]
    cfg = NarwhalConfig.model_validate({"engines": engines})
    feeds = ShardedKVFeeds(cfg.placement, [KVShard(64) for _ in range(3)])
    feeds._commands.extend(asyncio.Queue() for _ in range(3))  # no tasks: commands are only queued
    states = [EngineState(e) for e in cfg.engines]
    for e in states:
        feeds._follow(e)
    assert feeds.load == [334, 333, 333]
    shard = feeds.followed["e5"][0]
    feeds._follow(states[5])  # followed again (its shard restarted): same shard, new generation
    assert feeds.followed["e5"][0] == shard and feeds.load == [334, 333, 333]
    feeds.drop("e5")
    feeds.drop("e6")
    feeds._follow(states[5])  # followed anew (a new process): to the shard following the fewest
    assert sum(feeds.load) == 999 and max(feeds.load) - min(feeds.load) <= 1


def test_changes_of_an_older_follow_are_dropped() -> None:
    cfg = NarwhalConfig.model_validate({"engines": [{"name": "a", "url": "http://127.0.0.1:1", "kv_events": {
        "endpoint": "tcp://127.0.0.1:1"}}]})
    e = EngineState(cfg.engines[0])
    feeds = ShardedKVFeeds(cfg.placement, [KVShard(64)])
    feeds._commands.append(asyncio.Queue())  # no tasks: commands are only queued
    feeds._follow(e)
    gen = feeds.followed["a"][1]
    feeds.taken(0, Taken("s1", {"a": PrefixDelta(gen - 1, added=(1, 2)), "b": PrefixDelta(gen, added=(3,))}))
    assert not set(e.prefix.held()) and e.prefix_exact  # an older follow's, and an engine not followed
    feeds.taken(0, Taken("s1", {"a": PrefixDelta(gen, added=(4, 5), block_size=16)}))
    assert list(e.prefix.held()) == [4, 5] and e.cache_block_tokens == 16
    feeds.taken(0, Taken("s2", {"a": PrefixDelta(gen, added=(6,))}))  # the shard restarted: follow again
    assert not set(e.prefix.held()) and feeds.followed["a"][1] > gen
    # the first follow, a drop of the feed for b it should not have (not followed), the second follow
    assert [c[0] for c in feeds._commands[0]._queue] == ["follow", "drop", "follow"]  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- through the router


class Link:
    """A shard in this process, its answers pickled as across a Ray hop; can be made to fail, or
    swapped for a fresh shard (a restarted replica)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.shard = KVShard(block)
        self.failing = False
        self.calls: dict[str, int] = {"follow": 0, "drop": 0, "take": 0}

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if self.failing:
            raise ConnectionError("shard unreachable")

    async def follow(self, engine: str, gen: int, endpoint: str, replay_endpoint: str | None, topic: str) -> str:
        self._call("follow")
        return await self.shard.follow(engine, gen, endpoint, replay_endpoint, topic)

    async def drop(self, engine: str) -> str:
        self._call("drop")
        return await self.shard.drop(engine)

    async def take(self, wait_s: float) -> Taken:
        self._call("take")
        out: Taken = pickle.loads(pickle.dumps(await self.shard.take(min(wait_s, 0.2))))
        return out

    async def restart(self) -> None:
        old, self.shard = self.shard, KVShard(self.block)
        await old.stop()


@pytest.fixture
async def sharded() -> AsyncIterator[tuple[LocalRouter, list[Link]]]:
    ends = [endpoints() for _ in range(3)]
    links = [Link(32), Link(32)]
    r = await start_local_router({
        "placement": {"prefix_block_tokens": 32, "kv_event_shards": 2},
        "sim": {"engines": [{"name": f"u{i}", "role": "unified", "kv_block_size": 16, "num_gpu_blocks": 64,
                             "kv_events_endpoint": p, "kv_events_replay_endpoint": q} for i, (p, q) in enumerate(ends)]},
    }, kv_shards=links)
    yield r, links
    await r.stop()
    for link in links:
        await link.shard.stop()


async def test_through_two_shards_the_router_index_holds_exactly_the_engines_blocks(sharded: tuple[LocalRouter, list[Link]]) -> None:
    router, links = sharded
    followed = {name: i for name, (i, _, _) in router.svc.kv_events.followed.items()}  # type: ignore[union-attr]
    assert set(followed) == {"u0", "u1", "u2"} and set(followed.values()) == {0, 1}  # both shards used
    tok = SimTokenizer()
    body = {"model": "narwhal-sim", "prompt": "narwhal " * 120, "max_tokens": 1}
    want = set(id_block_hashes(tok.prompt("completion", body).ids, 32, 10_000))
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        r = await c.post("/v1/completions", json=body, headers={"X-Request-Id": "kv-1"})
        assert r.status_code == 200, r.text
        sim = next(s for s in router.sims if any(x["request_id"] == "kv-1" for x in s.engine.recent))
        name = sim.engine.cfg.name
        state = router.svc.engines[name]
        shard = links[followed[name]].shard
        await eventually(lambda: state.prefix.pending == 0 and set(state.prefix.held()) == want, "index follows the engine")
        assert shard.feeds[name].index.stats["stored"] >= 2 * len(want)  # applied there, not here
        assert state.cache_block_tokens == 16 and all(not set(e.prefix.held()) for n, e in router.svc.engines.items() if n != name)

        async def status() -> dict[str, Any]:
            st = (await c.get("/status")).json()
            out: dict[str, Any] = next(e for e in st["engines"] if e["name"] == name)
            return out

        for _ in range(100):  # the subscribers' states ride on a take once a second
            view = await status()
            if view["kv_events"].get("stored"):
                break
            await asyncio.sleep(0.05)
        assert view["prefix_source"] == "kv_events" and view["kv_events"]["shard"] == followed[name]
        assert view["kv_events"]["state"] == "subscribed" and view["kv_events"]["stored"] >= 2 * len(want)

        # the shard restarts (a new replica, nothing followed): the scheduler follows its engines
        # again, and the engine's replay socket gives the new one what the engine holds
        await links[followed[name]].restart()
        await eventually(lambda: name in links[followed[name]].shard.feeds, "followed again")
        await eventually(lambda: set(state.prefix.held()) == want, "rebuilt from the replay")

        # a shard that fails its calls: its sets stay, and when it answers again it follows anew
        link = links[followed[name]]
        link.failing = True
        takes = link.calls["take"]
        await eventually(lambda: link.calls["take"] > takes, "a failed take")
        link.failing = False
        follows = link.calls["follow"]
        await eventually(lambda: link.calls["follow"] > follows and set(state.prefix.held()) == want, "recovered", 10)

        sim.engine.clear_prefix_cache()
        await eventually(lambda: not set(state.prefix.held()), "cleared")


def test_a_done_requests_blocks_stay_pending_until_its_engines_events_are_taken() -> None:
    cfg = NarwhalConfig.model_validate({"engines": [{"name": "a", "url": "http://127.0.0.1:1", "kv_events": {
        "endpoint": "tcp://127.0.0.1:1"}}]})
    e = EngineState(cfg.engines[0])
    now = [0.0]
    feeds = ShardedKVFeeds(cfg.placement, [KVShard(64)], clock=lambda: now[0])
    feeds._commands.append(asyncio.Queue())
    feeds._follow(e)
    gen = feeds.followed["a"][1]
    feeds.taken(0, Taken("s1", {"a": PrefixDelta(gen, added=(1,))}))
    e.prefix.pend([1, 2, 3])  # placed: its prompt's blocks, the first one already cached
    assert feeds.unpend(e, [1, 2, 3])
    assert e.prefix.pending == 2 and set(e.prefix.held()) == {1, 2, 3}  # not in neither set meanwhile
    feeds.taken(0, Taken("s1", {"a": PrefixDelta(gen, added=(2,))}))  # the engine's events for them
    assert e.prefix.pending == 0 and set(e.prefix.held()) == {1, 2}  # (it did not keep block 3)
    e.prefix.pend([7])
    feeds.unpend(e, [7])
    now[0] = 0.5
    feeds._settle(e, now[0])
    assert e.prefix.pending == 1  # not due yet
    now[0] = 1.5
    feeds._settle(e, now[0])
    assert e.prefix.pending == 0  # the engine never named it: gone after the grace
    e.prefix.pend([8])
    feeds.unpend(e, [8])
    feeds.drop("a")
    assert e.prefix.pending == 0  # no longer followed: nothing waits
    assert not KVEventFeeds(cfg.placement).unpend(e, [9])  # in-process events: unpended by the caller
