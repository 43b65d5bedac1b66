"""The overhead bench's report: the refusal path of the build measured and, when it ran too, of its
``@base``, one row each."""

from __future__ import annotations

from narwhal_serve.bench.views import overhead_view


def _refusal(rate: float, cpu: float) -> dict[str, object]:
    return {"offered": 100, "refused": 100, "error_codes": ["prompt_exceeds_ttft_budget"], "refusals_per_s": rate,
            "latency_ms": {"p50": 20.0, "p99": 40.0}, "cpu_ms_per_refusal": cpu}


def test_the_refusal_path_of_the_base_build_is_its_own_row() -> None:
    ref = {**_refusal(1200.0, 1.02), "base": _refusal(1100.0, 1.11)}
    text, _ = overhead_view({"latency": {}, "throughput": {}, "refusal": ref, "checks": []})
    rows = [line.split() for line in text.splitlines() if "prompt_exceeds_ttft_budget" in line]
    assert [(r[0], r[1], r[-2]) for r in rows] == [("narwhal-predictive", "1200.00", "1.02"),
                                                  ("narwhal-predictive@base", "1100.00", "1.11")]
    text, _ = overhead_view({"latency": {}, "throughput": {}, "refusal": _refusal(1200.0, 1.02), "checks": []})
    assert sum("prompt_exceeds_ttft_budget" in line for line in text.splitlines()) == 1
