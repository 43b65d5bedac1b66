"""Percentiles, SLO judgement, goodput and Retry-After accuracy (narwhal_serve.bench.stats)."""

from __future__ import annotations

import numpy as np
import pytest

from narwhal_serve.bench.stats import (
    RequestResult,
    Slo,
    capacity_gaps,
    dist_ms,
    percentile,
    retry_after_accuracy,
    run_duration,
    summarize,
)

SLO = Slo(ttft_s=0.5, tpot_s=0.05)


def ok(idx: int, sent: float, ttft: float, e2e: float, tokens: int) -> RequestResult:
    return RequestResult(idx, "t", sent, 10, tokens, status=200, ok=True, ttft=ttft, e2e=e2e, output_tokens=tokens)


def refused(idx: int, sent: float, retry_after: float | None = 1.0, e2e: float = 0.01,
            retry_of: int | None = None) -> RequestResult:
    return RequestResult(idx, "t", sent, 10, 5, status=429, error_code="ttft_budget_exceeded",
                         retry_after=retry_after, e2e=e2e, retry_of=retry_of)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    xs = list(np.random.default_rng(1).lognormal(size=101))
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_dist_ms_converts_to_milliseconds() -> None:
    d = dist_ms([0.001, 0.002, 0.003])
    assert d["n"] == 3 and d["p50"] == 2.0 and d["mean"] == 2.0 and d["max"] == 3.0
    assert dist_ms([])["p99"] is None


def test_tpot_excludes_first_token() -> None:
    r = ok(0, 0.0, ttft=0.1, e2e=0.1 + 9 * 0.02, tokens=10)
    assert r.tpot == pytest.approx(0.02)
    assert ok(0, 0.0, 0.1, 0.1, 1).tpot is None


@pytest.mark.parametrize(
    "r, met",
    [
        (ok(0, 0, 0.5, 0.5 + 0.05 * 4, 5), True),  # both exactly at the limit
        (ok(0, 0, 0.51, 0.6, 5), False),  # ttft over
        (ok(0, 0, 0.1, 0.1 + 0.06 * 4, 5), False),  # tpot over
        (ok(0, 0, 0.1, 0.1, 1), True),  # one token: no tpot
        (refused(0, 0), False),
        (RequestResult(0, "t", 0, 1, 1, status=200, ok=False, ttft=0.1, e2e=0.2, output_tokens=3), False),
    ],
)
def test_slo_met(r: RequestResult, met: bool) -> None:
    assert SLO.met(r) is met


def test_summarize_goodput_attainment_and_refusals() -> None:
    rs = [
        ok(0, 0.0, 0.1, 0.3, 5),  # good
        ok(1, 1.0, 0.9, 1.2, 5),  # admitted, misses TTFT
        refused(2, 2.0),
        RequestResult(3, "t", 3.0, 1, 1, status=0, error_code="cut", e2e=1.0),  # failed
        ok(4, 3.0, 0.2, 0.4, 5),  # good (the cut one finishes last, at t=4.0)
    ]
    s = summarize(rs, SLO)
    assert s["duration_s"] == 4.0
    assert (s["offered"], s["completed"], s["admitted"], s["refused"], s["failed"], s["good"]) == (5, 3, 3, 1, 1, 2)
    assert s["goodput_rps"] == 0.5 and s["throughput_rps"] == 0.75
    assert s["slo_attainment_admitted"] == pytest.approx(2 / 3, abs=1e-4)
    assert s["refusal_rate"] == 0.2
    assert s["error_codes"] == {"ttft_budget_exceeded": 1, "cut": 1}
    assert s["ttft_ms"]["n"] == 3
    assert s["span_s"] == 4.0 and s["goodput_rps_span"] == 0.5
    w = summarize(rs, SLO, duration_s=2.0)  # open loop: per second of arrival window
    assert w["goodput_rps"] == 1.0 and w["goodput_rps_span"] == 0.5


def test_retries_do_not_count_as_offered() -> None:
    rs = [refused(0, 0.0), ok(0, 1.5, 0.1, 0.2, 3)]
    rs[1].retry_of = 0
    s = summarize(rs, SLO)
    assert s["offered"] == 1 and s["completed"] == 0
    ra = s["retry_after"]
    assert ra["retry_sample"] == 1 and ra["retry_success"] == 1.0 and ra["retry_good"] == 1.0


def test_capacity_gap_and_not_early() -> None:
    rs = [
        refused(0, 0.0, retry_after=1.0, e2e=0.1),  # refused at 0.1; next admitted send at 0.5
        ok(1, 0.5, 0.1, 0.2, 2),
        refused(2, 1.0, retry_after=1.0, e2e=0.0),  # at 1.0; next admitted send at 3.0
        ok(3, 3.0, 0.1, 0.2, 2),
        refused(4, 5.0),  # nothing admitted after: no gap
    ]
    gaps = capacity_gaps(rs)
    assert gaps == [(1.0, pytest.approx(0.4)), (1.0, pytest.approx(2.0))]
    acc = retry_after_accuracy(rs, SLO)
    assert acc["refusals_with_retry_after"] == 3
    assert acc["not_early"] == 0.5
    assert acc["gap_median_s"] == pytest.approx(1.2)
    assert acc["retry_sample"] == 0 and acc["retry_success"] is None


def test_run_duration_empty() -> None:
    assert run_duration([]) == 0.0
    assert run_duration([refused(0, 0.0, e2e=None)]) == 0.0  # type: ignore[arg-type]
