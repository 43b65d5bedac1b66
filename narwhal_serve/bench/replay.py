"""``narwhal-bench replay``: a trace through the router's real admission on a virtual clock
(:mod:`narwhal_serve.replay`), against a fleet of simulated engines — goodput, SLO attainment,
refusals by reason, Retry-After accuracy, engine utilisation and the TTFT prediction error, in
the same tables, JSON and plots as ``goodput``, in a fraction of the trace's time.

``--sweep`` is the planner: one replay per fleet shape (and admission mode) of a grid, and the
smallest fleet that meets the target (``--min-within-slo``, ``--max-refused``)."""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from narwhal_serve.bench.report import plot_lines, publish, run_dir, table
from narwhal_serve.bench.stats import RequestResult, Slo, summarize
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.replay.costs import Costs
from narwhal_serve.replay.run import REPLAY_ENGINE, FleetSpec, Replay, ReplayOptions, Served
from narwhal_serve.replay.trace import TraceRequest, load
from narwhal_serve.replay.vloop import run_virtual

TRACES = {"mooncake": "mooncake-fast25-conversation.jsonl.gz", "azure": "azure-llm-2023-conv.csv.gz"}
TRACE_DIR = Path(__file__).resolve().parent / "traces"


def trace_of(name: str) -> Path:
    return TRACE_DIR / TRACES[name] if name in TRACES else Path(name)


def _counts(spec: str) -> list[int]:
    """``4``, ``1,2,4`` or ``1..8``."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("..")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return out


def fleet_grid(spec: str, engine: SimEngineConfig) -> list[FleetSpec]:
    """``unified=4`` or ``prefill=1..2/decode=2,4`` → every combination, smallest first."""
    roles: dict[str, list[int]] = {}
    for item in spec.replace(" ", "").split("/"):
        role, _, counts = item.partition("=")
        try:
            if role not in ("prefill", "decode", "unified") or not counts:
                raise ValueError(item)
            roles[role] = _counts(counts)
        except ValueError:
            raise SystemExit(f"bad fleet {item!r}: want role=N, role=A..B or role=A,B,C (roles prefill, "
                             "decode, unified; several joined by /)") from None
    names = list(roles)
    shapes = [FleetSpec(engine=engine, **{"unified": 0, **dict(zip(names, combo))})
              for combo in itertools.product(*(roles[n] for n in names))]
    shapes = [f for f in shapes if f.unified or (f.prefill and f.decode)]
    return sorted(shapes, key=lambda f: (f.prefill + f.decode + f.unified, f.label))


def slice_trace(trace: list[TraceRequest], start_s: float, duration_s: float | None, limit: int | None
                ) -> list[TraceRequest]:
    if not trace:
        return trace
    t0 = trace[0].at_s + start_s
    out = [r for r in trace if r.at_s >= t0 and (duration_s is None or r.at_s < t0 + duration_s)]
    return out[:limit] if limit else out


def _result(s: Served) -> RequestResult:
    return RequestResult(s.idx, "replay", s.sent, s.prompt_tokens, s.max_tokens, s.status, s.ok, s.error_code,
                         s.retry_after, s.ttft, s.e2e, s.output_tokens, [], s.retry_of, s.predicted_ttft)


@dataclass(frozen=True)
class Target:
    within_slo: float = 0.99  # good (first try or its retry) / offered
    refused: float = 0.01  # never admitted / offered


def run_one(cfg: NarwhalConfig, fleet: FleetSpec, opts: ReplayOptions, trace: list[TraceRequest], slo: Slo,
            target: Target, costs: bool = False) -> tuple[dict[str, Any], list[RequestResult]]:
    rp = Replay(cfg, fleet, opts, costs=Costs() if costs else None)
    served = run_virtual(rp.run(trace))
    results = [_result(s) for s in served]
    span = (trace[-1].at_s - trace[0].at_s) / opts.speed if len(trace) > 1 else 0.0
    summary = summarize(results, slo, duration_s=span or None)
    first = [r for r in results if r.retry_of is None]
    good = sum(slo.met(r) for r in results)
    never = sum(1 for r in first if not r.admitted and not any(x.admitted for x in results if x.retry_of == r.idx))
    n = len(first)
    within = good / n if n else None
    refused = never / n if n else None
    util = list(rp.utilisation.values())
    row = {
        "fleet": fleet.label, "engines": fleet.prefill + fleet.decode + fleet.unified,
        "mode": cfg.admission.mode, "offered": n, "goodput_rps": summary["goodput_rps"],
        "within_slo": None if within is None else round(within, 4),
        "refused": None if refused is None else round(refused, 4),
        "meets": within is not None and refused is not None and within >= target.within_slo
        and refused <= target.refused,
        "ttft_p99_ms": summary["ttft_ms"]["p99"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
        "refusals": summary["error_codes"], "retry_after": summary["retry_after"],
        "ttft_prediction": summary["ttft_prediction"],
        "busy": round(sum(b for b, _ in util) / len(util), 3) if util else None,
        "batch_fill": round(sum(f for _, f in util) / len(util), 3) if util else None,
        "per_engine": {k: {"busy": round(b, 3), "batch_fill": round(f, 3)} for k, (b, f) in rp.utilisation.items()},
        "virtual_s": round(rp.virtual_s, 1), "wall_s": round(rp.wall_s, 2),
        "x_real_time": round(rp.virtual_s / rp.wall_s, 1) if rp.wall_s > 0 else None,
        "summary": summary,
    }
    if rp.costs is not None:  # per part of the router; core share at the trace's arrival rate
        row["costs"] = rp.costs.report(len(trace), span or rp.virtual_s)
        row["kv_blocks_per_request"] = round(rp.kv_blocks / len(trace), 1) if trace else None
        row["memory_mb"] = {k: round(v, 1) for k, v in rp.memory_mb.items()}
    return row, results


def costs_table(row: dict[str, Any]) -> str:
    return f"\n## what each part of the router cost ({row['fleet']}, CPU of this process)\n" + table(
        ["part", "calls", "CPU s", "µs per call", "p50 µs", "p99 µs", "µs per request", "share of a core"],
        [[c["part"], c["calls"], c["cpu_s"], c["us_per_call"], c["p50_us"], c["p99_us"], c["us_per_request"],
          c["core_share"]] for c in row["costs"]], nd=3) + "".join(
        f"\n{k}: {v} MB" for k, v in row.get("memory_mb", {}).items())


def rows_table(rows: list[dict[str, Any]]) -> str:
    return table(["fleet", "mode", "offered", "goodput rps", "within SLO", "refused", "meets", "TTFT p99 ms",
                  "TPOT p99 ms", "TTFT pred err p50", "retries admitted", "busy", "batch fill", "x real time"],
                 [[r["fleet"], r["mode"], r["offered"], r["goodput_rps"], r["within_slo"], r["refused"],
                   "yes" if r["meets"] else "no", r["ttft_p99_ms"], r["tpot_p99_ms"],
                   r["ttft_prediction"]["err_p50"], r["retry_after"]["retry_success"], r["busy"], r["batch_fill"],
                   r["x_real_time"]] for r in rows], nd=3)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="a trace through the real admission on a virtual clock; --sweep: the "
                                      "smallest fleet that meets a target")
    p.add_argument("--trace", default="azure", help="azure, mooncake, or a trace file (docs/performance.md, "
                                                   "\"Capacity planning by replay\": its format)")
    p.add_argument("--start-s", type=float, default=0.0, help="slice: seconds into the trace")
    p.add_argument("--duration-s", type=float, default=None, help="slice: seconds of trace (default: all)")
    p.add_argument("--requests", type=int, default=None, help="slice: at most this many requests")
    p.add_argument("--speed", type=float, default=1.0, help="time compression: arrivals this many times closer")
    p.add_argument("--fleet", default="unified=4",
                   help="engines by role: unified=4, prefill=1/decode=2; with --sweep ranges: unified=1..8")
    p.add_argument("--sweep", action="store_true", help="one replay per fleet of the --fleet grid (and --modes)")
    p.add_argument("--modes", default="predictive", help="admission modes swept (comma list of predictive, open)")
    p.add_argument("--engine-config", type=Path, default=None,
                   help="YAML of the simulated engines' settings (timing, max_num_seqs, num_gpu_blocks...)")
    p.add_argument("--config", type=Path, default=None, help="Narwhal config YAML (admission, placement...)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="also sent as each request's TPOT target")
    p.add_argument("--ingresses", type=int, default=2, help="virtual ingress replicas, each with its lease")
    p.add_argument("--no-retries", action="store_true", help="refused clients do not retry after Retry-After")
    p.add_argument("--hop-ms", type=float, default=0.0,
                   help="one-way time between the router and an engine (the network, the router's own path)")
    p.add_argument("--min-within-slo", type=float, default=0.99, help="the sweep's target: good / offered")
    p.add_argument("--max-refused", type=float, default=0.01, help="the sweep's target: never admitted / offered")
    p.add_argument("--costs", action="store_true",
                   help="measure the CPU of each part of the router that would run for real (scheduler, "
                        "KV-event index, leases, reports)")
    p.add_argument("--kv-shards", type=int, default=None,
                   help="the engines' KV events applied by this many shards, not the scheduler "
                        "(placement.kv_event_shards; with --costs each shard's CPU is kvshard.*)")
    p.add_argument("--out", type=Path, default=Path("bench-results"))


def main(ns: argparse.Namespace) -> int:
    engine = REPLAY_ENGINE
    if ns.engine_config is not None:
        engine = SimEngineConfig.model_validate({**REPLAY_ENGINE.model_dump(),
                                                 **(yaml.safe_load(ns.engine_config.read_text()) or {})})
    cfg = NarwhalConfig() if ns.config is None else NarwhalConfig.model_validate(
        yaml.safe_load(ns.config.read_text()) or {})
    fleets = fleet_grid(ns.fleet, engine)
    if not ns.sweep and len(fleets) != 1:
        raise SystemExit(f"--fleet {ns.fleet!r} names {len(fleets)} fleets: add --sweep, or give one count per role")
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()] if ns.sweep else [cfg.admission.mode]
    trace = slice_trace(load(trace_of(ns.trace)), ns.start_s, ns.duration_s, ns.requests)
    if not trace:
        raise SystemExit("the trace slice is empty")
    slo = Slo(ns.slo_ttft_ms / 1000.0, ns.slo_tpot_ms / 1000.0 if ns.slo_tpot_ms else float("inf"))
    cfg = cfg.model_copy(update={"admission": cfg.admission.model_copy(update={"ttft_budget_s": slo.ttft_s})})
    if ns.kv_shards is not None:
        cfg = cfg.model_copy(update={"placement": cfg.placement.model_copy(update={"kv_event_shards": ns.kv_shards})})
    opts = ReplayOptions(ttft_s=slo.ttft_s, tpot_s=ns.slo_tpot_ms / 1000.0 if ns.slo_tpot_ms else None,
                         ingresses=ns.ingresses, retries=not ns.no_retries, speed=ns.speed,
                         hop_s=ns.hop_ms / 1000.0)
    target = Target(ns.min_within_slo, ns.max_refused)
    out = run_dir(ns.out, "replay")
    rows: list[dict[str, Any]] = []
    for mode, fleet in itertools.product(modes, fleets):
        mcfg = cfg.model_copy(update={"admission": cfg.admission.model_copy(update={"mode": mode})})
        row, _ = run_one(mcfg, fleet, opts, trace, slo, target, ns.costs)
        rows.append(row)
        print(f"{fleet.label} {mode}: goodput {row['goodput_rps']} rps, within SLO {row['within_slo']}, "
              f"refused {row['refused']} ({row['wall_s']} s, {row['x_real_time']}x real time)", file=sys.stderr)
    span = trace[-1].at_s - trace[0].at_s
    res: dict[str, Any] = {
        "meta": {"mode": "replay", "argv": sys.argv[1:], "trace": str(trace_of(ns.trace)), "requests": len(trace),
                 "trace_span_s": round(span, 1), "speed": ns.speed, "engine": engine.model_dump(),
                 "slo": {"ttft_s": slo.ttft_s, "tpot_s": opts.tpot_s}, "target": vars(target)},
        "rows": rows,
    }
    text = rows_table(rows) + "".join(costs_table(r) for r in rows if "costs" in r)
    plots: list[str] = []
    if ns.sweep:
        best = {m: next((r for r in rows if r["mode"] == m and r["meets"]), None) for m in modes}
        res["smallest"] = {m: (b["fleet"] if b else None) for m, b in best.items()}
        for m, b in best.items():
            text += (f"\n{m}: smallest fleet meeting >= {target.within_slo:.0%} within SLO and <= {target.refused:.0%} "
                     f"refused: {b['fleet'] if b else 'none of the grid'}")
        for key, label in (("goodput_rps", "goodput (req/s)"), ("within_slo", "within SLO (share of offered)")):
            png = plot_lines(out / f"replay-{key}.png", f"replay: {label} against fleet size", "engines", label,
                           {f"{m}": [(r["engines"], r[key]) for r in rows if r["mode"] == m] for m in modes})
            if png is not None:
                plots.append(str(png))
    res["plots"] = plots
    return publish(out, res, text, plots)

