"""``narwhal-bench soak``'s report (:mod:`.soak`): the router's books after the run (every offered
request in one terminal class, gauges and permits back to zero), the checks, the text and the plot."""


from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any


from narwhal_serve.admission.counters import unbalanced
from narwhal_serve.bench.rss import mb, rss_summary, rss_table, rss_timeline
from narwhal_serve.bench.report import check, checks_table, plot_lines, table
from narwhal_serve.bench.soak_mix import SoakArgs

if TYPE_CHECKING:
    from narwhal_serve.bench.soak import Soak


def books(snap: dict[str, Any]) -> dict[str, Any]:
    """From a ``/status`` snapshot: offered against the terminal classes, permits still held."""
    c = snap.get("counters", {})
    off = unbalanced(c)
    gauges = {k: int(v) for k, v in snap.get("gauges", {}).items()}
    leases_in_use = sum(sum(int(x) for x in lease.get("in_use", {}).values())
                        for lease in snap.get("admission_leases", []))
    leaked = gauges.get("retained", 0) + gauges.get("prefill_inflight", 0) + gauges.get("decode_inflight", 0)
    return {"offered": int(c.get("offered", 0)), "terminal": int(c.get("offered", 0)) - off,
            "unbalanced": off, "gauges": gauges, "leaked_permits": leaked,
            "lease_permits_in_use": leases_in_use, "balanced": off == 0 and not any(gauges.values())}


def router_outcomes(snap: dict[str, Any]) -> list[tuple[str, str, int]]:
    return [(str(r["outcome"]), str(r["reason"]), int(r["count"])) for r in snap.get("counters_by_reason", [])]


def soak_checks(rss: Sequence[dict[str, Any]], book: dict[str, Any] | None, completed: int,
                max_growth_pct: float) -> list[dict[str, Any]]:
    out = [check("requests completed", float(completed), ">=", 1)]
    if book is None:
        out.append(check("/status read after quiescence", None, ">=", 1))
    else:
        out.append(check("leaked permits", float(book["leaked_permits"]), "<=", 0))
        out.append(check("counters: |offered - terminal|", float(abs(book["unbalanced"])), "<=", 0))
        out.append(check("gauges all zero (queued included)", float(sum(book["gauges"].values())), "<=", 0))
    for r in rss:
        if not r["judged"]:
            continue
        if r["verdict"] == "GONE":
            out.append(check(f"{r['role']} running at the end", 0.0, ">=", 1))
        else:
            out.append(check(f"RSS growth {r['role']} (%)", r["growth_pct"], "<", max_growth_pct))
    return out


def report(a: SoakArgs, soak: "Soak") -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """The results (JSON), the text to print and the checks."""
    rss = rss_summary(soak.samples, a.baseline_at_s, a.max_growth_pct)
    book = books(soak.final_status) if soak.final_status is not None else None
    checks = soak_checks(rss, book, soak.completed, a.max_growth_pct)
    lines = []
    judged_roles = [r["role"] for r in rss if r["judged"]]
    lines.append("## RSS over time (MB; judged roles, and the sum of Ray's own processes)")
    lines.append(rss_timeline(soak.samples, judged_roles))
    base_t = next((r["baseline_t"] for r in rss if r["baseline_t"] is not None), None)
    lines.append(f"\n## RSS per role (baseline: the first sample at or after {a.baseline_at_s:.0f} s"
                 + (" = 10 % of the load" if a.baseline_s is None else "") + f", here t = {base_t} s; "
                 f"growth = last / baseline - 1; judged: growth < {a.max_growth_pct:g} %; 'ray ...' roles are "
                 "Ray's own processes, reported only)")
    lines.append(rss_table(rss))
    lines.append("\n## requests (client side: kind, outcome)")
    lines.append(table(["kind", "outcome", "count"], [[k, o, n] for (k, o), n in sorted(soak.tally.items())]))
    lines.append("\nstatus codes: " + ", ".join(f"{k} {n}" for k, n in sorted(soak.statuses.items())))
    lines.append(f"\n## engine-wide faults ({len(soak.episodes)} episodes of {a.engine_fault_s:g} s)")
    lines += [f"  {e['start_s']:.0f}-{e['end_s']:.0f} s {e['fault']} on {e['engine']} "
              f"(control {e['on_status']}/{e['off_status']})" for e in soak.episodes]
    lines.append("\n## router (/status after quiescence)")
    if book is None or soak.final_status is None:
        lines.append("  /status could not be read")
    else:
        lines.append(table(["outcome", "reason", "count"], router_outcomes(soak.final_status)))
        lines.append(f"  offered {book['offered']}, terminal {book['terminal']} → "
                     f"{'balanced' if book['unbalanced'] == 0 else 'UNBALANCED by ' + str(book['unbalanced'])}; "
                     f"gauges {book['gauges']}; leaked permits {book['leaked_permits']}; "
                     f"quiescent after {soak.quiesce_s if soak.quiesce_s is not None else 'NOT within'} "
                     f"{'s' if soak.quiesce_s is not None else str(a.quiesce_timeout_s) + ' s'}")
    lines.append("")
    lines.append(checks_table(checks))
    res = {"rss": rss, "client": {"sent": soak.sent, "done": soak.done, "completed": soak.completed,
                                  "by_kind": [{"kind": k, "outcome": o, "count": n}
                                              for (k, o), n in sorted(soak.tally.items())],
                                  "status_codes": dict(sorted(soak.statuses.items()))},
           "router": {"books": book, "quiesce_s": soak.quiesce_s, "status": soak.final_status},
           "engine_faults": soak.episodes, "checks": checks}
    return res, "\n".join(lines), checks


def plot(soak: "Soak", roles: Sequence[str], path: Path) -> Path | None:
    series: dict[str, list[tuple[float, float | None]]] = {
        r: [(float(s["t"]), mb(s["roles"][r]["rss_kb"]) if r in s["roles"] else None) for s in soak.samples]
        for r in roles}
    return plot_lines(path, "RSS of Narwhal's processes under a soak", "seconds since the load started", "MB", series)
