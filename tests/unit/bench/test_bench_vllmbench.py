"""narwhal-bench vllm-bench: the benchmark's command line and how its results are summarized."""

from __future__ import annotations

import json
from pathlib import Path

from narwhal_serve.bench import vllmbench


def test_every_target_gets_the_same_benchmark_but_its_url_and_file() -> None:
    a = vllmbench.VllmBenchArgs(num_prompts=50, input_len=32, output_len=8, api="completions", seed=3)
    one = vllmbench.bench_argv(a, "http://127.0.0.1:1", 4.0, Path("/r"), "x.json")
    two = vllmbench.bench_argv(a, "http://127.0.0.1:2/predictive", 4.0, Path("/r"), "y.json")
    assert [v for v in one if v not in ("http://127.0.0.1:1", "x.json")] == \
        [v for v in two if v not in ("http://127.0.0.1:2/predictive", "y.json")]
    i = one.index
    assert one[i("--endpoint") + 1] == "/v1/completions" and one[i("--backend") + 1] == "openai"
    assert one[i("--seed") + 1] == "3" and "--ignore-eos" in one and one[i("--request-rate") + 1] == "4.0"


def test_read_result_and_medians_over_rounds_against_direct(tmp_path: Path) -> None:
    def result(ttft: float, itl: float, completed: int = 10, failed: int = 0) -> dict[str, object]:
        p = tmp_path / f"{ttft}-{itl}-{completed}.json"
        p.write_text(json.dumps({"p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "p50_tpot_ms": 1.0,
                                 "p99_itl_ms": itl, "p50_itl_ms": itl / 2, "completed": completed, "failed": failed}))
        return vllmbench.read_result(p)

    runs = {
        "direct": {4.0: [result(10, 4), result(12, 6), result(11, 5)]},
        "narwhal-predictive": {4.0: [result(20, 5), result(14, 7), result(15, 9, completed=9, failed=1)]},
    }
    s = vllmbench.summarize(runs)["4.0"]
    assert s["direct"]["p50_ttft_ms"] == 11 and s["direct"]["added_p50_ttft_ms"] == 0
    n = s["narwhal-predictive"]
    assert (n["p50_ttft_ms"], n["added_p50_ttft_ms"], n["added_p99_ttft_ms"]) == (15, 4, 8)
    assert (n["p99_itl_ms"], n["added_p99_itl_ms"]) == (7, 2)
    assert (n["completed"], n["failed"]) == (29, 1)
    assert "narwhal-predictive" in vllmbench.view(vllmbench.summarize(runs))
