"""Arrival generators, length samplers, prompts and bodies (narwhal_serve.bench.workload)."""

from __future__ import annotations

import numpy as np
import pytest

from narwhal_serve.bench.workload import LengthDist, Workload, arrival_times, build_body, make_prompt
from narwhal_serve.sim.textgen import encode_prompt


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_poisson_rate_and_seed() -> None:
    ts = arrival_times("poisson", 50.0, 100.0, rng(1))
    assert abs(len(ts) - 5000) < 4 * 5000**0.5  # within 4 sigma
    assert ts == sorted(ts) and 0 < ts[0] and ts[-1] < 100.0
    gaps = np.diff(ts)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.1)  # exponential: CV = 1
    assert ts == arrival_times("poisson", 50.0, 100.0, rng(1))
    assert ts != arrival_times("poisson", 50.0, 100.0, rng(2))


def test_constant_and_burst() -> None:
    assert arrival_times("constant", 4.0, 1.0, rng()) == [0.0, 0.25, 0.5, 0.75]
    b = arrival_times("burst", 8.0, 2.0, rng(), burst_size=4)
    assert b == [0.0] * 4 + [0.5] * 4 + [1.0] * 4 + [1.5] * 4
    assert arrival_times("poisson", 0.0, 10.0, rng()) == []
    assert len(arrival_times("constant", 1000.0, 10.0, rng(), max_requests=7)) == 7
    with pytest.raises(ValueError):
        arrival_times("burst", 1.0, 1.0, rng(), burst_size=0)


def test_lognormal_lengths_clipped_and_seeded() -> None:
    d = LengthDist(median=100, sigma=1.0, lo=10, hi=1000)
    xs = d.sample(rng(3), 20_000)
    assert min(xs) >= 10 and max(xs) <= 1000
    assert np.median(xs) == pytest.approx(100, rel=0.05)
    assert xs[:50] == d.sample(rng(3), 20_000)[:50]
    assert np.mean(xs) > np.median(xs)  # heavy right tail
    assert LengthDist(64, 0.0, 64, 64).sample(rng(), 5) == [64] * 5
    with pytest.raises(ValueError):
        LengthDist(10, 1.0, 5, 4)


def test_prompt_token_count_matches_simulator_and_sizing() -> None:
    p = make_prompt(rng(), 300)
    assert len(encode_prompt(p)) == 300 + 1  # BOS + one token per word
    assert abs((len(p) + 3) // 4 - 300) <= 1  # Narwhal sizes chars / 4


def test_specs_are_unique_and_reproducible() -> None:
    wl = Workload(LengthDist(32, 0.5, 8, 64), LengthDist(8, 0.5, 2, 16), seed=5)
    a = wl.specs([0.0, 0.1, 0.2])
    assert a == wl.specs([0.0, 0.1, 0.2])
    assert len({s.prompt.split()[0] + s.prompt.split()[1] for s in a}) == 3
    assert [s.idx for s in a] == [0, 1, 2] and [s.at for s in a] == [0.0, 0.1, 0.2]


def test_build_body() -> None:
    spec = Workload(LengthDist(4, 0, 4, 4), LengthDist(3, 0, 3, 3)).closed_loop_specs(1)[0]
    chat = build_body(spec, "chat", "m", stream=True)
    assert chat["messages"][0]["content"] == spec.prompt and chat["max_tokens"] == 3
    assert chat["stream_options"] == {"include_usage": True} and chat["ignore_eos"] is True
    comp = build_body(spec, "completions", "m", stream=False, ignore_eos=False)
    assert comp["prompt"] == spec.prompt and "stream_options" not in comp and "ignore_eos" not in comp
