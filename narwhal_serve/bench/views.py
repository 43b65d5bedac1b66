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
        lat = ref["latency_ms"]
        parts.append(table(["refusals/s", "offered", "refused", "p50 ms", "p99 ms", "cpu ms/refusal", "codes"],
                           [[ref["refusals_per_s"], ref["offered"], ref["refused"], lat["p50"], lat["p99"],
                             ref["cpu_ms_per_refusal"], ",".join(ref["error_codes"])]]))
    parts.append("\n## ARCHITECTURE targets")
    parts.append(checks_table(res["checks"]))
    return "\n".join(parts), []


def goodput_view(res: dict[str, Any], out: Path) -> tuple[str, list[Path]]:
    cap = res["capacity"]
    parts = [f"\n## SLO capacity: {cap.get('capacity_rps')} req/s ({cap.get('source')}; timing model "
             f"{cap.get('model_rps')} req/s; calibration throughput {cap.get('throughput_rps')} req/s at "
             f"c={cap.get('concurrency')})"]
    rows = res["rows"]
    parts.append("\n## rate sweep (ms; goodput = SLO-meeting completions per second of arrival window; "
                 "gp span = per second of first send..last finish, vLLM's; RA = Retry-After sample)")
    parts.append(table(
        ["load", "rps", "target", "n", "arrived", "thru", "goodput", "/cap", "gp span", "attain", "refused", "failed", "ttft p50",
         "ttft p99", "tpot p99", "itl p99", "RA n", "RA retry ok", "RA not early", "RA over s"],
        [[r["load"], r["offered_rps"], r["target"], r["offered"], r["arrived_rps"], r["throughput_rps"], r["goodput_rps"],
          r["goodput_vs_capacity"], r["goodput_rps_span"], r["slo_attainment_admitted"], r["refusal_rate"], r["failed"],
          r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p99"], r["itl_ms"]["p99"],
          r["retry_after"]["retry_sample"], r["retry_after"]["retry_success"], r["retry_after"]["not_early"],
          r["retry_after"]["overstatement_median_s"]] for r in rows]))
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
    parts.append("\n## ARCHITECTURE targets")
    parts.append(checks_table(res["checks"]))
    series_g: dict[str, list[tuple[float, float | None]]] = {}
    series_t: dict[str, list[tuple[float, float | None]]] = {}
    for r in rows:
        series_g.setdefault(r["target"], []).append((r["offered_rps"], r["goodput_rps"]))
        series_t.setdefault(r["target"], []).append((r["offered_rps"], r["ttft_ms"]["p99"]))
    plots = [p for p in (
        plot_lines(out / "goodput.png", f"goodput vs offered load (capacity {cap.get('capacity_rps')} req/s)",
                   "offered load (req/s)", "goodput (req/s meeting TTFT and TPOT SLOs)", series_g),
        plot_lines(out / "ttft_p99.png", "p99 TTFT vs offered load", "offered load (req/s)", "p99 TTFT (ms)",
                   series_t, log_y=True),
    ) if p is not None]
    return "\n".join(parts), plots
