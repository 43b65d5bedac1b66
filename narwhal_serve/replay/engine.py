"""The simulator's engine as discrete events on the loop's (virtual) clock.

The same engine as :class:`narwhal_serve.sim.engine.Engine` — its timing model
(:mod:`narwhal_serve.sim.timing`), prefix cache, KV events, counters and ``/metrics`` — with its
rules taken in events instead of one coroutine per request and one sleep per token: at most
``max_num_seqs`` sequences hold a slot (the rest wait in arrival order); serial prefills run one at
a time, first come first served, each taking ``prefill_seconds`` of its uncached tokens (the cache
looked up when it starts, filled when it ends); a decoding sequence's next token comes one
``token_interval(running)`` after its previous one, ``running`` read when that previous token came.

Between two changes of ``running`` every interval is the same, so the tokens in between are
counted, not stepped: the engine wakes only when a slot is taken or freed, a prefill ends or a
sequence ends.  ``tests/unit/replay/test_engine.py`` runs both engines on the same jobs and
checks they agree on every first and last token.  One difference: the simulator also caches the
blocks a request's output fills, as vLLM does (``cache_output_blocks``); here only prompts are
cached (its jobs carry no output token IDs), and the equality test turns that off.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.engine import Engine, Histogram, Scheduler
from narwhal_serve.sim.kvevents import KVEventSink
from narwhal_serve.sim.timing import prefill_deadline, token_interval


def observe_n(h: Histogram, v: float, n: int) -> None:
    """``n`` observations of ``v``."""
    h.sum += v * n
    h.count += n
    for i, b in enumerate(h.buckets):
        if v <= b:
            h.counts[i] += n


@dataclass(eq=False)
class ReplayJob:
    """One generation: its prompt (token IDs and the engine's block hashes of them) and how many
    tokens it outputs; ``on_first(t)`` at its first token, ``on_end(t, tokens)`` when it ends."""

    prompt_ids: list[int]
    hashes: list[int]
    output_tokens: int
    on_first: Callable[[float], None] | None = None
    on_end: Callable[[float, int], None] | None = None
    skip_prefill: bool = False
    arrival: float = 0.0
    seq: int = -1
    done: int = 0  # tokens out
    next_t: float = 0.0  # when its next token comes (decoding)
    last_t: float = 0.0  # when its last token came
    ended: bool = False
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def tokens_at(self, now: float, interval: float) -> int:
        """Tokens out by ``now`` (a decoding job between two of its engine's events)."""
        if self.done == 0 or self.ended or now < self.next_t:
            return self.done
        left = self.output_tokens - self.done
        return self.done + (left if interval <= 0 else min(left, int((now - self.next_t) / interval + 1e-9) + 1))


class _Slots(Scheduler):
    """The engine's sequence slots: ``running`` holders, ``queue`` waiting in arrival order."""

    def __init__(self, limit: Callable[[], int]) -> None:
        super().__init__(limit)
        self.queue: deque[ReplayJob] = deque()

    @property
    def waiting(self) -> int:
        return len(self.queue)


class ReplayEngine(Engine):
    def __init__(self, cfg: SimEngineConfig, loop: asyncio.AbstractEventLoop, kv_events: KVEventSink | None = None
                 ) -> None:
        super().__init__(cfg.model_copy(update={"kv_events_endpoint": None, "kv_events_replay_endpoint": None}))
        self.loop = loop
        self.slots = _Slots(lambda: self.cfg.max_num_seqs)
        self.scheduler = self.slots
        self.kv_events = kv_events
        self._prefills: deque[ReplayJob] = deque()
        self._prefilling = 0
        self._decoding: dict[ReplayJob, None] = {}
        self._interval = token_interval(cfg, 0)
        self._next_seq = 0
        self._end_timer: asyncio.TimerHandle | None = None
        self.busy_s = 0.0  # time with at least one sequence held
        self._busy_since: float | None = None
        self.seq_seconds = 0.0  # the integral of running over time
        self._changed_at = self._born = loop.time()

    # -- jobs ---------------------------------------------------------------------------------
    def submit(self, job: ReplayJob) -> None:
        now = self.loop.time()
        job.arrival = now
        if not self.slots.queue and self.slots.running < self.cfg.max_num_seqs:
            self._admit(job, now)
        else:
            self.slots.queue.append(job)

    def abort(self, job: ReplayJob) -> None:
        """The client left: its slot (or its place in the queue) is freed now."""
        if job.ended:
            return
        if job in self.slots.queue:
            self.slots.queue.remove(job)
            job.ended = True
            return
        if job in self._prefills:
            self._prefills.remove(job)
        self._finish(job, self.loop.time(), "abort")

    def _admit(self, job: ReplayJob, now: float) -> None:
        self._running(now, +1)
        job.seq = self._next_seq
        self._next_seq += 1
        self._tokens_held[job.seq] = len(job.prompt_ids)
        if job.skip_prefill:
            self._prefilled(job, now)
            return
        self._prefills.append(job)
        self._start_prefills(now)

    def _start_prefills(self, now: float) -> None:
        serial = self.cfg.prefill_mode == "serial"
        while self._prefills and (not serial or not self._prefilling):
            job = self._prefills.popleft()
            bs = self.cfg.kv_block_size
            cached = self.cache.cached_tokens(job.hashes, bs)
            self._prefilling += 1
            job._timer = self.loop.call_at(prefill_deadline(self.cfg, now, len(job.prompt_ids) - cached),
                                           self._prefill_done, job)

    def _prefill_done(self, job: ReplayJob) -> None:
        now = self.loop.time()
        job._timer = None
        self._prefilling -= 1
        self._prefilled(job, now)
        self._start_prefills(now)

    def _prefilled(self, job: ReplayJob, now: float) -> None:
        """Its prompt is in the cache and its first token is out."""
        # (its output's blocks are not cached: the replay's jobs carry no output token IDs, and the
        # trace's next turns name their prefix blocks themselves)
        self._cache_blocks(job.prompt_ids, job.hashes, self.cfg.kv_block_size)
        c = self.counters
        c.prompt_tokens += len(job.prompt_ids)
        c.ttft.observe(now - job.arrival)
        job.done, job.last_t = 1, now
        c.generation_tokens += 1
        self._tokens_held[job.seq] += 1
        if job.on_first is not None:
            job.on_first(now)
        if job.ended:  # (aborted from its callback)
            return
        if job.output_tokens <= 1:
            self._finish(job, now, "length")
            return
        job.next_t = now + self._interval
        self._decoding[job] = None
        self._arm()

    # -- decoding, counted between events ------------------------------------------------------
    def _settle(self, now: float) -> None:
        """Count every decoding job's tokens out by ``now`` (at the interval in force)."""
        iv = self._interval
        c = self.counters
        for job in self._decoding:
            n = job.tokens_at(now, iv) - job.done
            if n > 0:
                c.itl.observe(job.next_t - job.last_t)  # (its gap was set by the interval before)
                observe_n(c.itl, iv, n - 1)
                job.done += n
                job.last_t = job.next_t + (n - 1) * iv
                job.next_t = job.last_t + iv
                c.generation_tokens += n
                self._tokens_held[job.seq] += n

    def _running(self, now: float, delta: int) -> None:
        self._settle(now)
        self.seq_seconds += self.slots.running * (now - self._changed_at)
        self._changed_at = now
        before = self.slots.running
        self.slots.running += delta
        if before == 0 and self.slots.running > 0:
            self._busy_since = now
        elif self.slots.running == 0 and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None
        self._interval = token_interval(self.cfg, self.slots.running)

    def _end_at(self, job: ReplayJob) -> float:
        return job.next_t + (job.output_tokens - job.done - 1) * max(0.0, self._interval)

    def _arm(self) -> None:
        """One timer: the first decoding job to end."""
        if self._end_timer is not None:
            self._end_timer.cancel()
            self._end_timer = None
        if self._decoding:
            self._end_timer = self.loop.call_at(min(self._end_at(j) for j in self._decoding), self._ends)

    def _ends(self) -> None:
        self._end_timer = None
        now = self.loop.time()
        self._settle(now)
        for job in [j for j in self._decoding if j.done >= j.output_tokens]:
            self._finish(job, now, "length")
        self._arm()

    def _finish(self, job: ReplayJob, now: float, reason: str) -> None:
        if job._timer is not None:  # aborted in prefill
            job._timer.cancel()
            job._timer = None
            self._prefilling -= 1
        self._decoding.pop(job, None)
        job.ended = True
        self._tokens_held.pop(job.seq, None)
        c = self.counters
        c.success[reason] += 1
        c.e2e.observe(now - job.arrival)
        self._running(now, -1)
        while self.slots.queue and self.slots.running < self.cfg.max_num_seqs:
            self._admit(self.slots.queue.popleft(), now)
        self._start_prefills(now)
        self._arm()
        if job.on_end is not None:
            job.on_end(now, job.done)

    def tokens_of(self, job: ReplayJob, now: float) -> int:
        """Tokens ``job`` has out by ``now`` (it decodes here)."""
        return job.tokens_at(now, self._interval)

    def sync(self) -> None:
        """Counters as of now (before ``/metrics`` is rendered)."""
        self._settle(self.loop.time())

    def utilisation(self, now: float) -> tuple[float, float]:
        """(share of its time busy, mean running sequences over ``max_num_seqs``) up to ``now``."""
        busy = self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        seq_s = self.seq_seconds + self.slots.running * (now - self._changed_at)
        life = now - self._born
        return (busy / life, seq_s / (life * self.cfg.max_num_seqs)) if life > 0 else (0.0, 0.0)
