"""``narwhal-bench overhead|goodput|profile``: start the fleet and the targets, measure, print tables, write
``results.json``, ``requests.jsonl`` and PNG plots to ``--out/<mode>-<time>/``, stop everything.
``assembly``, ``decision`` and ``transport`` (see their modules) write ``results.json`` only;
``ramp`` (Serve autoscaling under a load ramp) and ``soak`` (a long mixed load with faults: memory of
every process, leaked permits) are described in their modules."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from narwhal_serve.bench import assembly, decision, profile, ramp, replay, soak, tenants, transport, transport_checks, views, vllmbench
from narwhal_serve.bench.cli_runs import key_value, ramp_args, ramp_parser, soak_args, soak_parser
from narwhal_serve.bench.fleet import TARGETS, Fleet, FleetSpec, SimTiming, known_target
from narwhal_serve.bench.goodput import GoodputArgs, GoodputRun, run_goodput_suite
from narwhal_serve.bench.overhead import OverheadArgs, run_overhead
from narwhal_serve.bench.report import RequestLog, publish, run_dir
from narwhal_serve.bench.stats import Slo
from narwhal_serve.bench.workload import LengthDist, Workload, WorkloadKind
from narwhal_serve.replay.trace import load_trace

T = TypeVar("T")
DEFAULT_TARGETS = {
    "overhead": ["direct", "proxy", "narwhal-open", "narwhal-predictive"],
    "goodput": ["direct", "narwhal-open", "narwhal-predictive", "rr"],
}
DEFAULT_TIMING = {
    "overhead": SimTiming(0.0, 0.0, 0.001, 0.0, 1024),
    "goodput": SimTiming(0.02, 0.0001, 0.025, 0.002, 4),
}
DEFAULT_TIMING["profile"] = DEFAULT_TIMING["overhead"]
DEFAULT_TIMING["vllm-bench"] = DEFAULT_TIMING["overhead"]
DEFAULT_ENGINES = {"overhead": 1, "goodput": 2, "profile": 1, "vllm-bench": 1}


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _targets(s: str) -> list[str]:
    ts = [x.strip() for x in s.split(",") if x.strip()]
    bad = [t for t in ts if not known_target(t)]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown target(s) {bad}; known: {', '.join(TARGETS)} "
                                         "(and narwhal-...@base with --baseline-tree)")
    return ts


WORKLOADS: tuple[WorkloadKind, ...] = ("lognormal", "shared-prefix", "mooncake", "azure", "mixed-script")
TRACES = {"mooncake": "mooncake-fast25-conversation.jsonl.gz", "azure": "azure-llm-2023-conv.csv.gz"}


def _workloads(s: str) -> list[WorkloadKind]:
    out: list[WorkloadKind] = []
    for x in (x.strip() for x in s.split(",") if x.strip()):
        kind = next((w for w in WORKLOADS if w == x), None)
        if kind is None:
            raise argparse.ArgumentTypeError(f"unknown workload {x!r}; known: {', '.join(WORKLOADS)}")
        if kind not in out:
            out.append(kind)
    return out


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("targets and fleet")
    g.add_argument("--targets", type=_targets, help=f"comma list of {', '.join(TARGETS)}")
    g.add_argument("--out", type=Path, default=Path("bench-results"), help="results folder (default %(default)s)")
    g.add_argument("--engine-url", action="append", default=[],
                   help="use this running engine (repeatable) instead of simulated ones")
    g.add_argument("--model", default="narwhal-sim", help="model id sent (and configured in Narwhal)")
    g.add_argument("--tokenizer", default=None,
                   help="with --engine-url: the engines' model directory, so Narwhal sizes prompts exactly "
                        "(simulated engines: the simulator's tokenizer)")
    g.add_argument("--engines", type=int, help="simulated engines in the fleet")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--prefill-overhead-s", type=float)
    g.add_argument("--prefill-per-token-s", type=float)
    g.add_argument("--tpot-base-s", type=float)
    g.add_argument("--tpot-per-running-s", type=float)
    g.add_argument("--narwhal-start-timeout-s", type=float, default=180.0)
    g.add_argument("--baseline-tree", type=Path, default=None,
                   help="another checkout of this repository (e.g. `git worktree add /tmp/base HEAD~1`): its "
                        "build serves the `<narwhal target>@base` targets, side by side in the same run")
    g.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for `serve run` (repeatable), e.g. RAY_SERVE_THROUGHPUT_OPTIMIZED=0")
    g.add_argument("--ray-niceness", type=int, default=0,
                   help="nice level of Narwhal's Ray workers (Ray's own default is 15, which on a shared "
                        "2-core machine puts the router behind the engines and the clients); default %(default)s")
    w = p.add_argument_group("requests")
    w.add_argument("--api", choices=["chat", "completions"], default="chat")
    w.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="narwhal-bench", description=__doc__)
    sub = p.add_subparsers(dest="mode", required=True)
    o = sub.add_parser("overhead", help="added latency, throughput, CPU per request, refusal path")
    _common(o)
    o.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="closed-loop clients (comma list)")
    o.add_argument("--phase-s", type=float, default=3.0, help="seconds per target per round per concurrency")
    o.add_argument("--rounds", type=int, default=2)
    o.add_argument("--tput-concurrency", type=_ints, default=[8, 64], help="closed-loop clients (comma list)")
    o.add_argument("--tput-s", type=float, default=4.0)
    o.add_argument("--refusal-s", type=float, default=4.0)
    o.add_argument("--prompt-tokens", type=int, default=64)
    o.add_argument("--output-tokens", type=int, default=16)
    o.add_argument("--distinct-prompts", type=int, default=512,
                   help="prompts in the pool the clients cycle through, every phase going on where the last "
                        "stopped (1: one prompt, which a real engine answers from its prefix cache: the "
                        "per-request costs alone; N larger than the run's requests: no prompt sent twice)")
    o.add_argument("--unique-tail", action="store_true",
                   help="end each request's prompt with its own number: no two texts alike (the router "
                        "tokenizes each one whole), all but their last tokens shared (an engine's prefix cache)")
    profile.add_parser(sub, _common)
    vllmbench.add_parser(sub, _common)
    d = sub.add_parser("decision", help="CPU cost of one admission decision, lease and scheduler (no servers)")
    d.add_argument("--engines", type=_ints, default=[3, 16, 64], help="fleet sizes (comma list)")
    d.add_argument("--requests", type=int, default=5000)
    d.add_argument("--tenants", type=_ints, default=[0], help="budgeted tenants (comma list; 0: no tenants section)")
    d.add_argument("--out", type=Path, default=Path("bench-results"))
    a = sub.add_parser("assembly", help="per-token CPU cost of assembly and relay (no servers)")
    a.add_argument("--tokens", type=int, default=20_000)
    a.add_argument("--out", type=Path, default=Path("bench-results"))
    t = sub.add_parser("transport", help="engine client HTTP stack: httpx vs httpx-aiohttp vs aiohttp (one sim)")
    t.add_argument("--variants", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   default=list(transport.VARIANTS), help="comma list of %(default)s")
    t.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="closed-loop clients (comma list)")
    t.add_argument("--rounds", type=int, default=3, help="rotated rounds (a multiple of the variants balances order)")
    t.add_argument("--requests", type=int, default=500, help="measured requests per variant per round per concurrency")
    t.add_argument("--warmup", type=int, default=32, help="unmeasured requests before each phase")
    t.add_argument("--tokens", type=int, default=16)
    t.add_argument("--tpot-s", type=float, default=0.0, help="simulated seconds per token")
    t.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                   help="client event loop (Ray runs async actors on uvloop when installed)")
    t.add_argument("--skip-checks", action="store_true", help="skip the correctness checks")
    t.add_argument("--model", default="narwhal-sim")
    t.add_argument("--out", type=Path, default=Path("bench-results"))
    replay.add_parser(sub)
    r = sub.add_parser("ramp", help="Serve autoscaling of Ingress and Assembler under a load ramp up and down")
    ramp_parser(r)
    s = sub.add_parser("soak", help="long mixed load with faults: RSS of every process, error classes, leaked permits")
    soak_parser(s)
    g = sub.add_parser("goodput", help="goodput and p99 TTFT over a rate sweep up to ~2x capacity")
    _common(g)
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=60.0)
    g.add_argument("--rates", type=_floats, default=[0.5, 0.8, 1.2, 2.0], help="fractions of SLO capacity")
    g.add_argument("--rates-rps", type=_floats, help="absolute request rates instead of --rates")
    g.add_argument("--capacity-rps", type=float, help="SLO capacity; skips estimation")
    g.add_argument("--calibrate-s", type=float, default=10.0, help="0: use the timing model's estimate")
    g.add_argument("--calib-concurrency", type=int)
    g.add_argument("--duration-s", type=float, default=10.0, help="arrival window per run")
    g.add_argument("--drain-s", type=float, default=8.0, help="wait after the last arrival before cutting")
    g.add_argument("--warmup-s", type=float, default=4.0)
    g.add_argument("--arrival", choices=["poisson", "constant", "burst"], default="poisson")
    g.add_argument("--burst-size", type=int, default=8)
    g.add_argument("--prompt-median", type=float, default=256)
    g.add_argument("--prompt-sigma", type=float, default=0.8)
    g.add_argument("--prompt-max", type=int, default=2048)
    g.add_argument("--output-median", type=float, default=24)
    g.add_argument("--output-sigma", type=float, default=0.6)
    g.add_argument("--output-max", type=int, default=128)
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = latency)")
    g.add_argument("--retry-samples", type=int, default=1000,
                   help="refusals retried once after their Retry-After, at most per run, spread over the window")
    g.add_argument("--retry-probability", type=float, default=0.2,
                   help="share of clients that retry (they send X-Stainless-Retry-Count, as the OpenAI SDKs do)")
    g.add_argument("--workload", type=_workloads, default=["lognormal"],
                   help=f"comma list of {', '.join(WORKLOADS)} (each swept in turn, with its own capacity; "
                        "default %(default)s)")
    g.add_argument("--trace-dir", type=Path, default=None,
                   help="mooncake / azure workloads: the folder holding the traces (default: the copies in "
                        "narwhal_serve/bench/traces, with their attribution)")
    g.add_argument("--trace-max-prompt", type=int, default=8192,
                   help="mooncake / azure: prompts clipped to this many tokens (the simulated engines' context "
                        "is raised to fit)")
    g.add_argument("--tenants", action="store_true",
                   help="the tenant scenarios (noisy neighbour, fairness, priority) on narwhal-predictive and "
                        "narwhal-tenants side by side, instead of the rate sweep (bench/tenants.py)")
    g.add_argument("--budget-s", type=float, default=60.0,
                   help="--tenants: seconds of the budget scenario (10x a tenant's requests per minute; 0: skip)")
    g.add_argument("--prefix-groups", type=int, default=8, help="shared-prefix: groups K")
    g.add_argument("--prefix-tokens", type=int, default=1500, help="shared-prefix: tokens of each group's prefix")
    g.add_argument("--suffix-tokens", type=int, default=32, help="shared-prefix: tokens of each prompt's own suffix")
    g.add_argument("--num-gpu-blocks", type=int,
                   help="simulated engines' KV/prefix-cache blocks (default: the simulator's 4096; shared-prefix: "
                        "(ceil(K / engines) + 1) prompts' worth)")
    return p


def fleet_spec(ns: argparse.Namespace, budget_s: float) -> FleetSpec:
    d = DEFAULT_TIMING[ns.mode]
    timing = SimTiming(
        prefill_overhead_s=d.prefill_overhead_s if ns.prefill_overhead_s is None else ns.prefill_overhead_s,
        prefill_per_token_s=d.prefill_per_token_s if ns.prefill_per_token_s is None else ns.prefill_per_token_s,
        tpot_base_s=d.tpot_base_s if ns.tpot_base_s is None else ns.tpot_base_s,
        tpot_per_running_s=d.tpot_per_running_s if ns.tpot_per_running_s is None else ns.tpot_per_running_s,
        max_num_seqs=d.max_num_seqs if ns.max_num_seqs is None else ns.max_num_seqs,
    )
    engines = len(ns.engine_url) or (ns.engines or DEFAULT_ENGINES[ns.mode])
    return FleetSpec(engines=engines, timing=timing, model=ns.model, external_urls=tuple(ns.engine_url),
                     narwhal_budget_s=budget_s, ray_niceness=ns.ray_niceness,
                     ray_env=tuple(key_value(kv) for kv in ns.ray_env),
                     # absolute: a --baseline-tree's `serve run` starts in another directory
                     tokenizer=str(Path(ns.tokenizer).resolve()) if ns.tokenizer and Path(ns.tokenizer).exists()
                     else ns.tokenizer,
                     baseline_tree=ns.baseline_tree)


def trace_path(ns: argparse.Namespace, name: str) -> Path:
    path = (ns.trace_dir or Path(__file__).resolve().parent / "traces") / TRACES[name]
    if not path.is_file():
        raise SystemExit(f"narwhal-bench: the {name} trace is not at {path} (give --trace-dir)")
    return path


def workload(ns: argparse.Namespace, kind: WorkloadKind) -> Workload:
    out = LengthDist(ns.output_median, ns.output_sigma, 2, ns.output_max)
    prompt = LengthDist(ns.prompt_median, ns.prompt_sigma, 8, ns.prompt_max)
    if kind == "shared-prefix":
        return Workload(LengthDist(ns.suffix_tokens, 0.0, ns.suffix_tokens, ns.suffix_tokens), out, seed=ns.seed,
                        prefix_groups=ns.prefix_groups, prefix_tokens=ns.prefix_tokens)
    if kind in TRACES:
        return Workload(prompt, out, seed=ns.seed, trace=load_trace(trace_path(ns, kind)), trace_name=kind,
                        max_prompt_tokens=ns.trace_max_prompt)
    return Workload(prompt, out, seed=ns.seed, mixed=kind == "mixed-script")


def goodput_args(ns: argparse.Namespace, kind: WorkloadKind | None = None) -> GoodputArgs:
    """The run of workload ``kind`` (default: the first of ``--workload``)."""
    wl = workload(ns, kind or ns.workload[0])
    return GoodputArgs(slo=Slo(ns.slo_ttft_ms / 1000, ns.slo_tpot_ms / 1000), rates=ns.rates, rates_rps=ns.rates_rps,
                       duration_s=ns.duration_s, drain_s=ns.drain_s, arrival=ns.arrival, burst_size=ns.burst_size,
                       workload=wl, calibrate_s=ns.calibrate_s, calib_concurrency=ns.calib_concurrency,
                       capacity_rps=ns.capacity_rps, warmup_s=ns.warmup_s, retry_samples=ns.retry_samples,
                       retry_probability=ns.retry_probability, num_gpu_blocks=ns.num_gpu_blocks,
                       api=ns.api, model=ns.model, stream=not ns.no_stream, seed=ns.seed)


def overhead_args(ns: argparse.Namespace) -> OverheadArgs:
    return OverheadArgs(concurrencies=ns.concurrency, phase_s=ns.phase_s, rounds=ns.rounds,
                        tput_concurrency=ns.tput_concurrency, tput_s=ns.tput_s, refusal_s=ns.refusal_s,
                        prompt_tokens=ns.prompt_tokens, output_tokens=ns.output_tokens, api=ns.api,
                        model=ns.model, seed=ns.seed, distinct_prompts=ns.distinct_prompts,
                        unique_tail=ns.unique_tail)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed (a cheaper client loop), else asyncio's."""
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:
        return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.mode == "decision":
        decision.run(run_dir(ns.out, "decision"), ns.engines, ns.requests, ns.tenants)
        return 0
    if ns.mode == "assembly":
        assembly.run(run_dir(ns.out, "assembly"), ns.tokens)
        return 0
    if ns.mode == "replay":
        return replay.main(ns)
    if ns.mode == "ramp":
        return ramp.run(ramp_args(ns), run_dir(ns.out, "ramp"), run_async)[1]
    if ns.mode == "soak":
        return soak.run(soak_args(ns), ns.out, run_async)[1]
    if ns.mode == "transport":
        bad = [v for v in ns.variants if v not in transport.VARIANTS]
        if bad:
            raise SystemExit(f"unknown variant(s) {bad}; known: {', '.join(transport.VARIANTS)}")
        out = run_dir(ns.out, "transport")
        targs = transport.TransportArgs(variants=ns.variants, concurrencies=ns.concurrency, rounds=ns.rounds,
                                        requests=ns.requests, warmup=ns.warmup, tokens=ns.tokens, tpot_s=ns.tpot_s,
                                        model=ns.model, checks=not ns.skip_checks)
        res = transport.run(targs, out, ns.loop)
        if res["checks"]:
            print(transport_checks.checks_table([transport_checks.Check(**c) for c in res["checks"]]) + "\n")
        print(transport.summary_table(res["summary"]))
        print(f"\nresults: {out / 'results.json'}")
        return 0
    if ns.mode == "profile":
        return profile.main(ns, fleet_spec(ns, 2.0), run_async)
    if ns.mode == "vllm-bench":
        return vllmbench.main(ns, fleet_spec(ns, 2.0))
    targets: list[str] = ns.targets or DEFAULT_TARGETS[ns.mode]
    if ns.mode == "goodput" and ns.tenants:
        targets = ["direct", tenants.BASELINE, tenants.TENANTS, *([tenants.TENANTS3] if ns.budget_s > 0 else [])]
    if ns.mode == "goodput" and "direct" not in targets and not ns.capacity_rps:
        targets = ["direct", *targets]  # the calibration run needs the engines directly
    args: GoodputArgs | OverheadArgs = goodput_args(ns) if ns.mode == "goodput" else overhead_args(ns)
    budget = args.slo.ttft_s if isinstance(args, GoodputArgs) else 2.0
    if isinstance(args, GoodputArgs) and "narwhal-prefix-blind" in targets and not {"shared-prefix", "mooncake"} & set(ns.workload):
        print("narwhal-prefix-blind runs on shared-prefix and mooncake workloads only", file=sys.stderr)
    out = run_dir(ns.out, ns.mode)
    fleet = Fleet(fleet_spec(ns, budget), out / "logs")
    t0 = time.monotonic()
    print(f"narwhal-bench {ns.mode}: targets {', '.join(targets)}; results in {out}", file=sys.stderr)
    try:
        fleet.start(targets, ns.narwhal_start_timeout_s)
        print(f"fleet ready in {time.monotonic() - t0:.1f} s (narwhal {fleet.narwhal_startup_s or 0:.1f} s): "
              f"engines {', '.join(fleet.engine_urls)}", file=sys.stderr)
        if isinstance(args, GoodputArgs) and ns.tenants:
            res = run_async(tenants.run_tenant_scenarios(args, GoodputRun(args, fleet, targets), ns.budget_s))
        elif isinstance(args, GoodputArgs):
            res = run_async(run_goodput_suite([goodput_args(ns, k) for k in ns.workload], fleet, targets))
        else:
            res = run_async(run_overhead(args, fleet, targets))
    finally:
        fleet.stop()
    log = RequestLog(out / "requests.jsonl")
    for tags, rs in res.pop("_log"):
        log.write(tags, rs)
    meta = {"mode": ns.mode, "argv": sys.argv[1:] if argv is None else argv, "targets": targets,
            "fleet": {"engines": fleet.engine_urls, "spec": repr(fleet.spec)}, "args": repr(args),
            **({"workloads": ns.workload} if isinstance(args, GoodputArgs) else {}),
            "wall_s": round(time.monotonic() - t0, 1), "narwhal_startup_s": fleet.narwhal_startup_s}
    if isinstance(args, GoodputArgs):
        text, plots = views.goodput_view(res, out)
    else:
        text, plots = views.overhead_view(res)
    res = {"meta": meta, "definitions": views.DEFINITIONS, **res, "plots": [str(p) for p in plots]}
    return publish(out, res, text, plots, f"per request: {out / 'requests.jsonl'}")


if __name__ == "__main__":
    sys.exit(main())
