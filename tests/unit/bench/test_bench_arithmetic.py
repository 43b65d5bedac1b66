"""Review of the benchmark's numbers: each test shows a reported figure computed wrongly.

Pure functions and coroutines over synthetic samples; no servers (the fleet is a stub and the
closed-loop phase is replaced by a recorder)."""

from __future__ import annotations

import asyncio
from typing import Any

from narwhal_serve.bench import decision
from narwhal_serve.bench.overhead import OverheadArgs, OverheadRun
from narwhal_serve.bench.stats import RequestResult, percentile

# --- narwhal-bench decision: p50 / p99 (README's "41 µs p50 / 101 µs p99", docs/performance.md) ---
#
# Definition relied on: a p-th percentile of n distinct samples, by any standard definition
# (nearest rank: the ceil(p/100 * n)-th smallest; linear interpolation, numpy's default and the one
# stats.percentile uses), is at most the linear-interpolated value, and for p < 100 with n = 100
# distinct samples it is below the maximum; the median of an even sample is at most the mean of
# its two middle values.


def _us(values: list[int]) -> list[float]:
    return [v * 1e-6 for v in values]


def test_decision_p99_of_100_samples_is_not_the_maximum() -> None:
    xs = _us(list(range(1, 101)))  # 1..100 µs
    p = decision._pct(xs)
    assert p["p99_us"] < 100.0  # nearest rank: 99; linear: 99.01; reported: 100 (the maximum)


def test_decision_p99_at_the_default_5000_requests_is_one_rank_high() -> None:
    xs = _us(list(range(1, 5001)))  # the default --requests 5000
    p = decision._pct(xs)
    want = round(percentile(xs, 99) * 1e6, 1)  # 4950.0 (linear); nearest rank also 4950
    assert p["p99_us"] <= want  # reported: 4951


def test_decision_p50_of_an_even_sample_is_not_the_upper_middle_value() -> None:
    xs = _us([1, 2, 3, 4])
    assert decision._pct(xs)["p50_us"] <= 2.5  # median 2.5 (nearest rank 2); reported: 3


# --- narwhal-bench overhead: the refusal path ------------------------------------------------


class _Fleet:
    """What OverheadRun reads of a fleet here: no process tree (CPU reads as nothing)."""

    endpoints: dict[str, Any] = {}

    def process(self, target: str) -> None:
        return None


def _recording_run(a: OverheadArgs, targets: list[str]) -> tuple[OverheadRun, list[tuple[str, str, int]]]:
    run = OverheadRun(a, _Fleet(), targets)  # type: ignore[arg-type]
    calls: list[tuple[str, str, int]] = []

    async def closed(target: str, label: str, concurrency: int, duration_s: float, stream: bool,
                     out_tokens: int, headers: tuple[tuple[str, str], ...] = (), on_start: Any = None
                     ) -> list[RequestResult]:
        calls.append((target, label, concurrency))
        return [RequestResult(idx=i, target=target, sent=i * 0.01, prompt_tokens=64, max_tokens=out_tokens,
                              status=429, error_code="prompt_exceeds_ttft_budget", e2e=0.002) for i in range(100)]

    run.closed = closed  # type: ignore[method-assign]
    return run, calls


def test_refusal_path_candidate_and_base_are_not_always_run_in_the_same_order() -> None:
    # The project's rule (overhead.py's docstring, docs/performance.md): targets run in rotated
    # order, `rounds` times, so that machine drift hits both alike.  With rounds=2 the @base build
    # must lead at least once; refusals() runs narwhal-predictive once, always first, then @base.
    a = OverheadArgs(rounds=2)
    run, calls = _recording_run(a, ["direct", "narwhal-predictive", "narwhal-predictive@base"])
    asyncio.run(run.refusals())
    order = [t for t, label, _ in calls if label == "refusal"]
    assert any(order[i] == "narwhal-predictive@base" and "narwhal-predictive" in order[i + 1:]
               for i in range(len(order))), order


def test_refusals_vs_successes_ratio_compares_the_same_concurrency() -> None:
    # overhead_checks: "refusals/s ÷ successes/s at c=8" divides the refusal phase's rate by the
    # c=8 non-streaming success rate; the refusal phase must then run at c=8 too (it runs at 32).
    a = OverheadArgs()
    run, calls = _recording_run(a, ["direct", "narwhal-predictive"])
    asyncio.run(run.refusals())
    conc = {c for _, label, c in calls if label == "refusal"}
    assert conc == {8}, conc
