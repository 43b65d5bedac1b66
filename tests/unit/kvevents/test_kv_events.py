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
from narwhal_serve.placement.prefix import PrefixIndex, id_block_hashes, matched_blocks
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
    # a block ending a router block keeps no tokens once hashed; the ones inside keep theirs (8
    # bytes an ID), for another prompt branching after them
    assert [len(idx._nodes[h][index._TOKENS] or b"") // 8 for h in eh[:10]] == [16, 16, 16, 0] * 2 + [16, 16]
    ours = id_block_hashes(ids, 64, 10)
    # the last engine block of the second router block leaves, and comes back (the engine computed it again)
    idx.offer(1, batch(BlockRemoved([eh[7]], "GPU")))
    assert set(target.held()) == {ours[0]}
    idx.offer(2, batch(stored([eh[7]], eh[6], ids[112:128], 16)))
    assert set(target.held()) == set(ours[:2])  # the same router block, though its first three keep no tokens
    idx.offer(3, batch(stored(eh[10:12], eh[9], ids[160:192], 16)))
    assert set(target.held()) == set(ours[:3])


def test_prompts_branching_inside_a_router_block_each_get_their_own_keys() -> None:
    """(Found by a hostile review.) Two prompts sharing 96 tokens (6 engine blocks of 16) branch
    inside the second router block of 64: each router block is keyed by its own tokens — the keys
    every ingress computes for that prompt — never by a key found on a block shared with the
    other prompt (the second prompt matched 1 block of 4, and a prompt the engine held 2 blocks of
    matched 4). A shared block lists every router block built on it: its eviction takes each out."""
    target = PrefixIndex(1000)
    idx = KVEventIndex(router_block_tokens=64, capacity=10_000, target=target)
    p1 = list(range(1000, 1256))
    p2 = p1[:96] + list(range(7000, 7160))
    h1, h2 = chain(p1, 16), chain(p2, 16)
    assert h1[:6] == h2[:6] and h1[6] != h2[6]
    idx.offer(0, batch(stored(h1, None, p1, 16)))
    idx.offer(1, batch(stored(h2[6:], h2[5], p2[96:], 16)))  # the engine reuses the shared six
    k1, k2 = id_block_hashes(p1, 64, 10), id_block_hashes(p2, 64, 10)
    assert set(target.held()) == set(k1) | set(k2)
    assert matched_blocks(target.held(), k2) == 4 and matched_blocks(target.held(), k1) == 4
    mixed = id_block_hashes(p1[:128] + p2[128:], 64, 10)  # held: its first 2 router blocks (p1's), no more
    assert matched_blocks(target.held(), mixed) == 2
    idx.offer(2, batch(BlockRemoved([h1[5]], "GPU")))  # shared, inside router block 2 of both
    assert matched_blocks(target.held(), k1) == 1 and matched_blocks(target.held(), k2) == 1


def test_a_block_inside_a_router_block_stored_again_makes_it_whole_again() -> None:
    """(Found by a hostile review.) A block inside a router block evicted (the router block out),
    then the engine computes it again and announces it with the blocks after it that it kept: the
    router block is held again."""
    target = PrefixIndex(1000)
    idx = KVEventIndex(router_block_tokens=64, capacity=10_000, target=target)
    ids = list(range(3000, 3128))
    eh, keys = chain(ids, 16), id_block_hashes(ids, 64, 10)
    idx.offer(0, batch(stored(eh, None, ids, 16)))
    idx.offer(1, batch(BlockRemoved([eh[1]], "GPU")))
    assert matched_blocks(target.held(), keys) == 0
    idx.offer(2, batch(stored(eh[1:], eh[0], ids[16:], 16)))
    assert set(target.held()) == set(keys) and matched_blocks(target.held(), keys) == 2


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


def test_frames_no_publisher_of_vllms_format_sends_are_malformed_and_change_nothing() -> None:
    """(Found by a hostile review.) A sequence number that is not 8 bytes (one of 9 was a gap that
    cleared the index, then a restart that cleared it again), a block hash that is neither an int
    nor at most 64 bytes (a list raised mid-batch, after the sequence had moved on), an absurd
    block size (one block of 65,536 tokens rounded every match down to nothing), a frame nested
    past the decoder's recursion limit (it restarted the subscriber forever): each is counted as
    a malformed frame, and the index is untouched."""
    import msgspec

    sub = KVEventSubscriber("e", "tcp://127.0.0.1:1", None, "", KVEventIndex(64, 1000, PrefixIndex(100)))
    ids = list(range(64))
    good = encode_batch(batch(stored(chain(ids, 16), None, ids, 16)))
    assert sub._decode([b"", (0).to_bytes(8, "big"), good]) is not None
    enc = msgspec.msgpack.Encoder()
    nested = b"\x92" + enc.encode(1.0) + b"\x91" * 5000 + b"\x01"  # [ts, [[[[...1]]]]], 5,000 deep
    def ev(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "medium": "GPU", **fields}

    def frame(*events: dict[str, Any]) -> list[bytes]:
        return [b"", (1).to_bytes(8, "big"), enc.encode([time.time(), list(events)])]

    ok = ev("BlockStored", block_hashes=[b"h" * 32], parent_block_hash=None, token_ids=ids[:16], block_size=16,
            lora_id=None, lora_name=None)
    assert sub._decode(frame(ok, ev("BlockRemoved", block_hashes=[b"h" * 32, 5]))) is not None  # vLLM's: bytes or int
    bad = [
        [b"", (1 << 70).to_bytes(9, "big"), good],
        frame(ok, ev("BlockRemoved", block_hashes=[[1, 2]])),  # (the removal after a good store: all or nothing)
        frame({**ok, "parent_block_hash": {"a": 1}}),
        frame(ev("BlockRemoved", block_hashes=[b"x" * 65536])),
        frame({**ok, "block_hashes": [7], "token_ids": [0] * 65536, "block_size": 65536}),
        [b"", (1).to_bytes(8, "big"), nested],
    ]
    for frames in bad:
        assert sub._decode(frames) is None
    assert sub.errors["malformed_frames"] == len(bad)


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


def test_a_batch_stamped_in_the_future_does_not_hide_a_restart() -> None:
    """(Found by a hostile review.) Restarts were told from duplicates against the latest time
    ever seen: after one batch stamped in the future, a restarted engine's batches were taken as
    duplicates for good (its blocks never indexed, the old ones held). Now against the last batch's."""
    idx = KVEventIndex(16, 1000, PrefixIndex(100))
    ids = list(range(32))
    t0 = time.time()
    idx.offer(0, batch(stored(chain(ids, 16)[:1], None, ids[:16], 16), ts=t0))
    idx.offer(1, batch(ts=t0 + 3600))  # a stepped clock, or a skewed one
    idx.offer(2, batch(ts=t0 + 1))
    assert idx.offer(0, batch(stored(chain(ids, 16)[1:], None, ids[16:], 16), ts=t0 + 2)) == "restart"
    assert idx.stats["restarts"] == 1 and len(idx) == 1  # only the new engine's block
    with pytest.raises(ValueError):  # (a time that is no time does not decode)
        decode_batch(encode_batch(batch(ts=float("inf"))))


def test_blocks_of_another_tier_leave_the_devices_index_alone() -> None:
    """(Found by a hostile review.) vLLM's CPU offloading announces the host tier's stores and
    removals with ``medium: "CPU"``: a host-tier removal took blocks the device still held out of
    the index. The index follows the device's cache (``GPU``, which vLLM-CPU's own cache is too)."""
    target = PrefixIndex(1000)
    idx = KVEventIndex(64, 1000, target)
    ids = list(range(2000, 2064))
    eh = chain(ids, 16)
    idx.offer(0, batch(stored(eh, None, ids, 16)))
    idx.offer(1, batch(BlockStored(eh, None, ids, 16, None, "CPU", None), BlockRemoved(eh[:1], "CPU")))
    assert set(target.held()) == set(id_block_hashes(ids, 64, 10)) and idx.stats["other_medium"] == 2
    idx.offer(2, batch(BlockRemoved(eh[:1], "GPU")))
    assert not target.held()


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


async def test_a_restarted_subscriber_replays_from_the_batch_after_its_last() -> None:
    """A subscriber task restarted (after a failure) keeps its index: it asks the replay socket
    for what came after its last batch, not for the whole buffer again (all duplicates)."""
    pub_ep, replay_ep = endpoints()
    pub = SimKVPublisher(pub_ep, replay_ep)
    try:
        sub, target, task = await _subscribe(pub_ep, replay_ep)
        first = publish_prompt(pub, list(range(64))) + publish_prompt(pub, list(range(100, 164)))
        await eventually(lambda: set(first) <= set(target.held()), "live")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        missed = publish_prompt(pub, list(range(200, 264)))  # while it was down
        task = asyncio.get_running_loop().create_task(sub.run())
        await eventually(lambda: set(first + missed) <= set(target.held()), "replayed after the restart")
        assert sub.index.stats["duplicates"] == 0 and sub.index.stats["resyncs"] == 0
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


def test_a_closed_sim_publisher_leaves_no_socket_files(tmp_path: Any) -> None:
    """ZMQ does not remove an ipc:// socket's file when the socket closes: every simulated engine
    left two in /tmp (106 after a day of test runs here, each named after a free port)."""
    from pathlib import Path

    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = SimKVPublisher(pub_ep, replay_ep)
    files = [Path(tmp_path) / "pub", Path(tmp_path) / "replay"]
    assert all(f.exists() for f in files)
    pub.close()
    assert not any(f.exists() for f in files)


def test_a_closing_publisher_leaves_another_s_socket_at_its_endpoint(tmp_path: Any) -> None:
    """A publisher that bound the same endpoint since (a restarted engine on the same path) keeps its
    socket file when the first one closes: removed only if it is still the file this one bound."""
    from pathlib import Path

    ep = f"ipc://{tmp_path}/pub"
    old = SimKVPublisher(ep, None)
    new = SimKVPublisher(ep, None)  # (ZMQ replaces the file)
    old.close()
    assert (Path(tmp_path) / "pub").exists()
    new.close()
    assert not (Path(tmp_path) / "pub").exists()
