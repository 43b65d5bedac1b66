"""The printed tables and the plots of each mode's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from narwhal_serve.bench import stats
from narwhal_serve.bench.report import checks_table, plot_lines, table

DEFINITIONS = (stats.__doc__ or "").strip()


def _short(label: str) -> str:
    """``ray::ServeReplica:app:Ingress`` → ``Ingress``; ``ray::ProxyActor`` → ``ProxyActor``."""
    return label.rsplit(":", 1)[-1] if label.startswith("ray::ServeReplica:") else label.removeprefix("ray::")


def overhead_view(res: dict[str, Any]) -> tuple[str, list[Path]]:
    parts: list[str] = []
    for c, rows in res["latency"].items():
        parts.append(f"\n## latency, closed loop c={c}, streaming (ms)")
        parts.append(table(
            ["target", "n", "fail", "ttft p50", "ttft p99", "+ttft p50", "+ttft p99", "itl p99", "+itl p99",
             "chunks/req", "ttft p50 /proxy"],
            [[t, r["n"], r["failed"], r["ttft_p50"], r["ttft_p99"], r["added_ttft_p50"], r["added_ttft_p99"],
              r["itl_p99"], r["added_itl_p99"], r["chunks_per_req"], r["ttft_p50_vs_proxy"]] for t, r in rows.items()]))
    for c, tp in res["throughput"].items():
        parts.append(f"\n## throughput, closed loop c={c}, non-streaming, 4 tokens; CPU of the target's process tree")
        parts.append(table(
            ["target", "req/s", "/proxy", "/direct", "fail", "cpu ms/req", "net of idle", "sim ms/req", "loadgen ms/req"],
            [[t, r["req_per_s"], r["vs_proxy"], r["vs_direct"], r["failed"], r["cpu_ms_per_req"],
              r["cpu_ms_per_req_net"], r["sim_cpu_ms_per_req"], r["loadgen_cpu_ms_per_req"]] for t, r in tp.items()]))
        for t, r in tp.items():
            if t.startswith("narwhal"):
                top = list(r["by_process_ms_per_req"].items())[:8]
                parts.append(f"  {t} CPU ms/req by process: " + ", ".join(f"{_short(k)} {v}" for k, v in top))
    ref = res.get("refusal")
    if ref:
        parts.append("\n## refusal path (narwhal-predictive, X-TTFT-Target 0.001, c=32, non-streaming)")
        refs = [("narwhal-predictive", ref)] + ([("narwhal-predictive@base", ref["base"])] if ref.get("base") else [])
        parts.append(table(["target", "refusals/s", "offered", "refused", "p50 ms", "p99 ms", "cpu ms/refusal", "codes"],
                           [[t, r["refusals_per_s"], r["offered"], r["refused"], r["latency_ms"]["p50"],
                             r["latency_ms"]["p99"], r["cpu_ms_per_refusal"], ",".join(r["error_codes"])]
                            for t, r in refs]))
    parts.append("\n## targets")
    parts.append(checks_table(res["checks"]))
    return "\n".join(parts), []


def _cap_line(cap: dict[str, Any]) -> str:
    line = (f"\n## {cap.get('workload', 'lognormal')}: SLO capacity {cap.get('capacity_rps')} req/s "
            f"({cap.get('source')}; timing model {cap.get('model_rps')} req/s; calibration throughput "
            f"{cap.get('throughput_rps')} req/s at c={cap.get('concurrency')})")
    if cap.get("model_rps_prefix_cached") is not None:
        line += (f"\n   every prefix cached: {cap['model_rps_prefix_cached']} req/s (prefix gain ceiling "
                 f"{cap.get('prefix_gain_ceiling')}x); prefix cache {cap.get('sim_cache_blocks')} blocks per engine")
    return line


def admission_table(rows: list[dict[str, Any]]) -> str:
    """The admission issue's per-run measures: refused share, retries admitted, TTFT prediction error."""
    def frac(k: int, n: int, f: float | None) -> str:
        return f"{k}/{n} ({f:.2f})" if f is not None else f"{k}/{n}"

    return table(
        ["load", "target", "refused", "refused share", "retries admitted", "retry good", "ttft pred err p50",
         "p90", "bias p50", "pred n"],
        [[r["load"], r["target"], r["refused"], r["refusal_rate"],
          frac((ra := r["retry_after"])["retries_admitted"], ra["retry_sample"], ra["retry_success"]),
          ra["retry_good"], (p := r["ttft_prediction"])["err_p50"], p["err_p90"], p["bias_p50"], p["n"]]
         for r in rows], nd=3)


def _hits(engines: dict[str, Any] | None) -> str:
    v = (engines or {}).get("prefix_hit_rate")
    return "-" if v is None else f"{v:.2f}"


def _per_engine(engines: dict[str, Any] | None) -> str:
    return ",".join(str(n) for n in (engines or {}).get("requests", [])) or "-"


def goodput_view(res: dict[str, Any], out: Path) -> tuple[str, list[Path]]:
    parts: list[str] = []
    plots: list[Path] = []
    for cap in res.get("capacities") or [res["capacity"]]:
        kind = cap.get("workload", "lognormal")
        rows = [r for r in res["rows"] if r.get("workload", "lognormal") == kind]
        text, ps = _goodput_workload(cap, rows, out, "" if kind == "lognormal" else f"-{kind}")
        parts.append(text)
        plots += ps
    if res.get("tenant_rows"):
        parts.append(tenants_table(res["tenant_rows"]))
    for b in res.get("budget_rows") or []:
        parts.append("\n## tenant budget across the ingress replicas\n" + table(
            ["requests/min", "offered rps", "offered", "admitted", "span s", "bound", "overshoot", "retries",
             "retries admitted", "share"],
            [[b["requests_per_minute"], b["offered_rps"], b["offered"], b["admitted"], b["span_s"], b["bound"],
              b["overshoot"], b["retries"], b["retries_admitted"], b["retry_admitted_share"]]], nd=3))
    gain = res.get("prefix_gain")
    if gain:
        parts.append("\n## prefix gain (narwhal-predictive goodput / narwhal-prefix-blind)")
        parts.append(table(["workload", "load", "predictive", "prefix-blind", "gain", "cache hits pred / blind",
                            "oracle hits", "requests per engine pred / blind"],
                           [[g.get("workload", "shared-prefix"), g["load"], g["predictive_goodput_rps"],
                             g["blind_goodput_rps"], g["gain"],
                             f"{_hits(g['predictive_engines'])} / {_hits(g['blind_engines'])}",
                             "-" if g.get("oracle_hit_rate") is None
                             else f"{g['oracle_hit_rate']:.2f} (pred {g.get('hits_vs_oracle')}x)",
                             f"{_per_engine(g['predictive_engines'])} / {_per_engine(g['blind_engines'])}"]
                            for g in gain], nd=3))
    parts.append("\n## targets")
    parts.append(checks_table(res["checks"]))
    return "\n".join(parts), plots


def tenants_table(rows: list[dict[str, Any]]) -> str:
    """The tenant scenarios, one line per scenario, target and tenant."""
    lines = [[r["scenario"], r["target"], t, p["class"] or "-", p["load"], p["offered_rps"], p["goodput_rps"],
              p["goodput_vs_offered"], p["slo_attainment_admitted"], p["refusal_rate"], p["ttft_p99_ms"],
              r["goodput_vs_capacity"], r["jain"]]
             for r in rows for t, p in r["tenants"].items()]
    return "\n## tenant scenarios\n" + table(
        ["scenario", "target", "tenant", "class", "load", "offered rps", "goodput rps", "goodput / offered",
         "SLO attained (admitted)", "refused", "TTFT p99 ms", "total goodput / capacity", "Jain"], lines, nd=3)


def invalid_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """A line per run in which the engine (or Narwhal) called requests invalid: such a run measures
    the workload's mistake (on a real engine, usually prompt + max_tokens over its context), not
    admission; every target counts those requests as failed."""
    out = []
    for r in rows:
        bad = int(r.get("status_counts", {}).get("400", 0))
        if bad:
            out.append(f"WARNING: {bad} of {r['offered']} requests to {r['target']} at {r['load']}x were refused as "
                       "invalid (400): check that the prompts plus max_tokens fit the engine's context")
    return out


def _goodput_workload(cap: dict[str, Any], rows: list[dict[str, Any]], out: Path,
                      suffix: str) -> tuple[str, list[Path]]:
    parts = [_cap_line(cap)]
    parts.append("\n## rate sweep (ms; goodput = SLO-meeting completions, good retries included, per second of "
                 "arrival window; gp span = per second of first send..last finish, vLLM's; RA = Retry-After sample)")
    parts.append(table(
        ["load", "rps", "target", "n", "arrived", "thru", "goodput", "/cap", "gp span", "attain", "refused", "failed", "ttft p50",
         "ttft p99", "tpot p99", "itl p99", "RA n", "RA retry ok", "RA not early", "RA over s"],
        [[r["load"], r["offered_rps"], r["target"], r["offered"], r["arrived_rps"], r["throughput_rps"], r["goodput_rps"],
          r["goodput_vs_capacity"], r["goodput_rps_span"], r["slo_attainment_admitted"], r["refusal_rate"], r["failed"],
          r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p99"], r["itl_ms"]["p99"],
          r["retry_after"]["retry_sample"], r["retry_after"]["retry_success"], r["retry_after"]["not_early"],
          r["retry_after"]["overstatement_median_s"]] for r in rows]))
    parts.extend(invalid_warnings(rows))
    loads = sorted({r["load"] for r in rows})
    by = {(r["target"], r["load"]): r for r in rows}
    ratio_rows = []
    for x in loads:
        d = by.get(("direct", x), {}).get("goodput_rps")
        rr = by.get(("rr", x), {}).get("goodput_rps")
        for t in sorted({r["target"] for r in rows}):
            if (t, x) in by:
                g = by[(t, x)]["goodput_rps"]
                ratio_rows.append([x, t, g, stats.ratio(g, d), stats.ratio(g, rr)])
    parts.append("\n## goodput ratios")
    parts.append(table(["load", "target", "goodput", "/direct", "/rr"], ratio_rows, nd=3))
    parts.append("\n## admission (refused share; retries admitted after Retry-After; |TTFT - predicted| / TTFT)")
    parts.append(admission_table(rows))
    series_g: dict[str, list[tuple[float, float | None]]] = {}
    series_t: dict[str, list[tuple[float, float | None]]] = {}
    for r in rows:
        series_g.setdefault(r["target"], []).append((r["offered_rps"], r["goodput_rps"]))
        series_t.setdefault(r["target"], []).append((r["offered_rps"], r["ttft_ms"]["p99"]))
    plots = [p for p in (
        plot_lines(out / f"goodput{suffix}.png",
                   f"goodput vs offered load (capacity {cap.get('capacity_rps')} req/s){suffix}",
                   "offered load (req/s)", "goodput (req/s meeting TTFT and TPOT SLOs)", series_g),
        plot_lines(out / f"ttft_p99{suffix}.png", f"p99 TTFT vs offered load{suffix}", "offered load (req/s)",
                   "p99 TTFT (ms)", series_t, log_y=True),
    ) if p is not None]
    return "\n".join(parts), plots
