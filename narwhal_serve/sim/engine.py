"""The simulated engine: FIFO admission of at most ``max_num_seqs`` sequences, prefill and decode
timing, the prefix cache, counters for ``/metrics`` and the request log for ``/sim/stats``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.scripts import Output, Step
from narwhal_serve.sim.kvevents import KVEventSink, SimKVPublisher
from narwhal_serve.sim.timing import PrefixCache, block_hashes, next_token_deadline, prefill_deadline

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)


class Scheduler:
    """At most ``limit()`` holders; the rest wait in arrival order, or, with priorities (vLLM's
    priority policy), by priority (lower first), then arrival."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._priority: dict[asyncio.Future[None], int] = {}

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiting if not f.done())

    async def acquire(self, priority: int = 0) -> None:
        if not self._waiting and self.running < self._limit():
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        if priority:
            self._priority[fut] = priority
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted and cancelled in the same tick: hand the slot on
            else:
                self._waiting.remove(fut)
            raise
        finally:
            self._priority.pop(fut, None)

    def _pop(self) -> asyncio.Future[None]:
        if not self._priority:
            return self._waiting.popleft()
        best = min(self._waiting, key=lambda f: self._priority.get(f, 0))  # (min is stable: arrival order)
        self._waiting.remove(best)
        return best

    def release(self) -> None:
        self.running -= 1
        self.wake()

    def wake(self) -> None:
        """Admit waiters while there is room (also after ``max_num_seqs`` grows)."""
        while self._waiting and self.running < self._limit():
            fut = self._pop()
            if not fut.done():
                self.running += 1
                fut.set_result(None)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    sum: float = 0.0
    count: int = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))


@dataclass
class TimerLateness:
    """How far the host kept this engine's timing: a prefill that wakes late delays every prefill
    queued behind it (each starts when the one before ends), so on a host short of CPU a simulated
    engine serves less than its timing says.  ``prefill_late_s / prefill_s`` is that shortfall."""

    prefills: int = 0
    prefill_s: float = 0.0  # the prefills' modelled time
    prefill_late_s: float = 0.0  # their wake-ups after their deadlines, summed

    def prefill(self, modelled_s: float, late_s: float) -> None:
        self.prefills += 1
        self.prefill_s += modelled_s
        self.prefill_late_s += max(0.0, late_s)


@dataclass
class Job:
    """One admitted generation: its prompt, what it outputs and whether prefill is skipped."""

    prompt_ids: list[int]
    output: Output
    skip_prefill: bool = False
    arrival: float = 0.0
    block_ids: list[int] = field(default_factory=list)
    priority: int = 0  # vLLM's: lower is admitted first (engines with priority scheduling)


class Engine:
    """Shared state of one simulated engine (one per app)."""

    def __init__(self, cfg: SimEngineConfig) -> None:
        self.cfg = cfg
        self.scheduler = Scheduler(lambda: self.cfg.max_num_seqs)
        self.cache = PrefixCache(cfg.num_gpu_blocks)
        self.kv_events: KVEventSink | None = None
        if cfg.kv_events_endpoint:
            self.kv_events = SimKVPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint,
                                            buffer_steps=cfg.kv_events_buffer_steps)
        self.counters = Counters()
        self.timer = TimerLateness()
        self.recent: deque[dict[str, Any]] = deque(maxlen=50)
        self.total_requests = 0
        self.port = 0
        self._tokens_held: dict[int, int] = {}
        self._seq = itertools.count()
        self._prefill = asyncio.Lock()  # prefill_mode serial: FIFO (asyncio locks are fair)
        self._shutdown: asyncio.Event | None = None

    # ---- configuration / bookkeeping -------------------------------------------------------------

    def clear_prefix_cache(self) -> None:
        """vLLM's ``reset_prefix_cache``: every block gone (``AllBlocksCleared``)."""
        self.cache.clear()
        if self.kv_events is not None:
            self.kv_events.publish([self.kv_events.cleared()])

    def reconfigure(self, cfg: SimEngineConfig) -> None:
        if cfg.kv_block_size != self.cfg.kv_block_size:
            self.clear_prefix_cache()
        self.cache.capacity = cfg.num_gpu_blocks
        self.cfg = cfg
        self.scheduler.wake()

    def record(self, path: str, request_id: str | None, body: Any, traceparent: str | None = None) -> None:
        self.total_requests += 1
        self.recent.append(
            {"path": path, "request_id": request_id, "body": body, "received_at": time.time(), "traceparent": traceparent}
        )

    def kv_usage(self) -> float:
        bs, cap = self.cfg.kv_block_size, self.cfg.num_gpu_blocks
        used = sum(math.ceil(n / bs) for n in self._tokens_held.values())
        return min(1.0, used / cap)

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.cfg.name,
            "running": self.scheduler.running,
            "waiting": self.scheduler.waiting,
            "total_requests": self.total_requests,
            "prefix_cache_blocks": len(self.cache),
            "timer": asdict(self.timer),
            "requests": list(self.recent),
        }

    # ---- shutdown (releases hanging handlers) ---------------------------------------------------

    def _shutdown_event(self) -> asyncio.Event:
        if self._shutdown is None:
            self._shutdown = asyncio.Event()
        return self._shutdown

    def shutdown(self) -> None:
        self._shutdown_event().set()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def _cache_blocks(self, prompt_ids: list[int], hashes: list[int], bs: int) -> list[int]:
        """Cache the full blocks of the tokens computed so far (a prefilled prompt; then each block
        its output fills), announcing the new and the evicted ones (KV events)."""
        ids, new, evicted = self.cache.insert_tracked(hashes)
        pub = self.kv_events
        if pub is not None and (new or evicted):
            events = [pub.removed(evicted)] if evicted else []
            # new blocks of a chain are contiguous after the cached prefix (chained hashes)
            if new:
                first = new[0]
                events.append(pub.stored([hashes[i] for i in new], hashes[first - 1] if first else None,
                                         prompt_ids[first * bs:(new[-1] + 1) * bs], bs))
            pub.publish(events)
        return ids

    async def stall(self) -> None:
        """Wait until the app shuts down (a handler stalls here until cancelled by a disconnect)."""
        await self._shutdown_event().wait()

    # ---- generation -----------------------------------------------------------------------------

    async def run(self, job: Job) -> AsyncGenerator[Step, None]:
        """Admit ``job``, then yield its steps at their simulated times (first after prefill).

        Use through ``contextlib.aclosing`` so an abandoned stream releases its slot at once.
        """
        loop = asyncio.get_running_loop()
        job.arrival = loop.time()
        c = self.counters
        await self.scheduler.acquire(job.priority)
        seq = next(self._seq)
        finished = False
        try:
            cfg, bs = self.cfg, self.cfg.kv_block_size
            hashes = block_hashes(job.prompt_ids, bs)
            self._tokens_held[seq] = len(job.prompt_ids)
            if job.skip_prefill:
                deadline = loop.time()
                job.block_ids = self._cache_blocks(job.prompt_ids, hashes, bs)
            else:
                # serial: one prefill at a time, first come first served (vLLM spends a token budget
                # per step on waiting prefills in arrival order, so they add up); a request queued
                # behind one with the same prefix finds its blocks cached when its turn comes
                async with self._prefill if cfg.prefill_mode == "serial" else contextlib.nullcontext():
                    cached = self.cache.cached_tokens(hashes, bs)
                    start = loop.time()
                    deadline = prefill_deadline(cfg, start, len(job.prompt_ids) - cached)
                    await asyncio.sleep(max(0.0, deadline - loop.time()))
                    self.timer.prefill(deadline - start, loop.time() - deadline)
                    job.block_ids = self._cache_blocks(job.prompt_ids, hashes, bs)
            if len(job.prompt_ids) % bs:
                job.block_ids.append(self.cache.fresh_block_id())
            c.prompt_tokens += len(job.prompt_ids)
            last = loop.time()
            c.ttft.observe(last - job.arrival)
            computed = list(job.prompt_ids)  # the tokens in its KV cache
            chain = list(hashes)  # their full blocks' hashes (each new one chained to the last)
            for i, step in enumerate(job.output.steps):
                if i:
                    deadline = next_token_deadline(self.cfg, deadline, loop.time(), self.scheduler.running)
                    await asyncio.sleep(max(0.0, deadline - loop.time()))
                    now = loop.time()
                    c.itl.observe(now - last)
                    last = now
                    # this step ran the last token through the model: a block it fills is cached and
                    # announced as vLLM caches every full block at every step (kv_cache_manager.py)
                    computed.append(job.output.steps[i - 1].token.token_id)
                    if self.cfg.cache_output_blocks and len(computed) % bs == 0:
                        chain += block_hashes(computed[-bs:], bs, chain[-1] if chain else 0)
                        self._cache_blocks(computed, chain, bs)
                c.generation_tokens += 1
                self._tokens_held[seq] += 1
                yield step
            finished = True
        finally:
            self._tokens_held.pop(seq, None)
            self.scheduler.release()
            reason = job.output.finish_reason if finished else "abort"
            c.success["stop" if reason in ("tool_calls", "function_call") else reason] += 1
            c.e2e.observe(loop.time() - job.arrival)
