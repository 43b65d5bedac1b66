"""The replay's event-driven engine against the simulator's own engine: the same jobs, arriving at
the same virtual times, get their first and last tokens at the same times, and the engines end
with the same counters and prefix cache (the replay engine takes the simulator's rules in events:
it must be the same engine)."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.replay.engine import ReplayEngine, ReplayJob
from narwhal_serve.replay.vloop import run_virtual
from narwhal_serve.sim.engine import Engine, Job
from narwhal_serve.sim.scripts import Output, Step
from narwhal_serve.sim.textgen import GenToken
from narwhal_serve.sim.timing import block_hashes


def _jobs(seed: int, n: int) -> list[tuple[float, list[int], int]]:
    rng = random.Random(seed)
    groups = [[rng.randrange(1000) for _ in range(rng.randrange(16, 200))] for _ in range(4)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(40.0)
        prompt = rng.choice(groups) + [5000 + i] * rng.randrange(1, 120)  # shared prefixes, own suffixes
        out.append((t, prompt, rng.randrange(1, 60)))
    return out


def _output(n: int) -> Output:
    tok = GenToken(7, "x", "x", 0.0, ())
    return Output(tuple(Step("content", "x", tok) for _ in range(n)), "length", None)


async def _sim(cfg: SimEngineConfig, jobs: list[tuple[float, list[int], int]]) -> tuple[list[tuple[float, float, int]], Engine]:
    loop = asyncio.get_running_loop()
    engine = Engine(cfg)
    t0 = loop.time()

    async def one(at: float, prompt: list[int], n: int) -> tuple[float, float, int]:
        await asyncio.sleep(at - (loop.time() - t0))
        first = -1.0
        count = 0
        async with contextlib.aclosing(engine.run(Job(prompt, _output(n)))) as steps:
            async for _ in steps:
                count += 1
                if first < 0:
                    first = loop.time() - t0
        return first, loop.time() - t0, count

    results = await asyncio.gather(*(one(*j) for j in jobs))
    return list(results), engine


async def _replay(cfg: SimEngineConfig, jobs: list[tuple[float, list[int], int]]
                  ) -> tuple[list[tuple[float, float, int]], ReplayEngine]:
    loop = asyncio.get_running_loop()
    engine = ReplayEngine(cfg, loop)
    t0 = loop.time()
    results: list[tuple[float, float, int]] = [(-1.0, -1.0, 0)] * len(jobs)
    done = asyncio.Event()
    left = [len(jobs)]

    def submit(i: int, prompt: list[int], n: int) -> None:
        firsts: list[float] = []

        def on_end(t: float, tokens: int) -> None:
            results[i] = (firsts[0] - t0, t - t0, tokens)
            left[0] -= 1
            if not left[0]:
                done.set()

        engine.submit(ReplayJob(prompt, block_hashes(prompt, cfg.kv_block_size), n,
                                on_first=firsts.append, on_end=on_end))

    for i, (at, prompt, n) in enumerate(jobs):
        loop.call_at(t0 + at, submit, i, prompt, n)
    await done.wait()
    return results, engine


@pytest.mark.parametrize("mode,seqs", [("serial", 8), ("parallel", 8), ("serial", 64)])
def test_same_first_and_last_tokens_as_the_simulator(mode: str, seqs: int) -> None:
    # (timings off any common grid: events at the very same instant happen in either order in the
    # simulator, whichever timer its loop pops first)
    cfg = SimEngineConfig(max_num_seqs=seqs, prefill_mode=mode, num_gpu_blocks=40, cache_output_blocks=False,
                          prefill_overhead_s=0.0021137,
                          prefill_per_token_s=0.00051379, tpot_base_s=0.0041731, tpot_per_running_s=0.00071293)
    jobs = _jobs(seqs, 300)
    sim, sim_engine = run_virtual(_sim(cfg, jobs))
    rep, rep_engine = run_virtual(_replay(cfg, jobs))
    assert [r[2] for r in rep] == [n for _, _, n in jobs] == [s[2] for s in sim]
    for (sf, se, _), (rf, re_, _) in zip(sim, rep):
        assert rf == pytest.approx(sf, abs=1e-6)
        assert re_ == pytest.approx(se, abs=1e-6)
    a, b = sim_engine.counters, rep_engine.counters
    assert (a.prompt_tokens, a.generation_tokens, a.itl.count, a.ttft.count) == \
        (b.prompt_tokens, b.generation_tokens, b.itl.count, b.ttft.count)
    assert a.itl.sum == pytest.approx(b.itl.sum, rel=1e-9)
    assert sim_engine.cache.hits == rep_engine.cache.hits > 0  # the prefix cache hit the same blocks
    assert rep_engine.slots.running == 0 and not rep_engine.slots.queue
