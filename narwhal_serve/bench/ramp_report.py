"""``narwhal-bench ramp``'s readings (:mod:`.ramp`): the samples of Serve's status the sampler
wrote, the timeline of replicas against load, its summary and checks, its table and plot."""


from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from narwhal_serve.bench.report import check, plot_lines, table
from narwhal_serve.bench.stats import RequestResult
from narwhal_serve.config import DeploymentKnobs

APP = "narwhal"
DEPLOYMENTS = ("Ingress", "Assembler")


def level_at(sched: list[tuple[float, int]], t: float) -> int:
    level = 0
    for start, n in sched:
        if start > t:
            break
        level = n
    return level


def outcome(r: RequestResult) -> str:
    return "ok" if r.ok else "refused" if r.refused else "failed"


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The sampler's JSON lines so far (a half-written last line is skipped)."""
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def replicas(sample: dict[str, Any], deployment: str) -> dict[str, int]:
    """``{state: count}`` of one deployment in one sample (empty when absent or failed)."""
    dep = sample.get("apps", {}).get(APP, {}).get("deployments", {}).get(deployment, {})
    return {str(k): int(v) for k, v in dep.get("replicas", {}).items()}


def replica_cell(counts: dict[str, int]) -> str:
    """``2`` running, ``2+1`` with one starting, ``2-1`` with one stopping."""
    if not counts:
        return "-"
    cell = str(counts.get("RUNNING", 0))
    starting = sum(v for k, v in counts.items() if k in ("STARTING", "UPDATING", "RECOVERING"))
    if starting:
        cell += f"+{starting}"
    if counts.get("STOPPING"):
        cell += f"-{counts['STOPPING']}"
    return cell


def settled(sample: dict[str, Any], mins: dict[str, int]) -> bool:
    """Every deployment at its minimum, all running, none starting or stopping."""
    for dep, lo in mins.items():
        c = replicas(sample, dep)
        if c.get("RUNNING", 0) != lo or sum(c.values()) != lo:
            return False
    return True



def timeline(samples: list[dict[str, Any]], results: list[RequestResult], sched: list[tuple[float, int]],
             t0_wall: float) -> list[dict[str, Any]]:
    """One row per sample: seconds since the load started, clients allowed, requests in flight,
    replicas of each deployment (by state), requests finished so far by outcome."""
    ends = sorted((r.sent + (r.e2e or 0.0), outcome(r)) for r in results if r.e2e is not None)
    load_end = sched[-1][0]
    rows = []
    for s in samples:
        if "apps" not in s:
            continue
        t = float(s["t"]) - t0_wall
        done = Counter(o for e, o in ends if e <= t)
        row: dict[str, Any] = {
            "t": round(t, 2),
            "clients": level_at(sched, t) if 0 <= t < load_end else 0,
            "in_flight": sum(1 for r in results if r.sent <= t and (r.e2e is None or t < r.sent + r.e2e)),
            "ok": done["ok"], "failed": done["failed"], "refused": done["refused"],
        }
        for d in DEPLOYMENTS:
            row[d] = replicas(s, d)
        rows.append(row)
    return rows


def summarize_ramp(rows: list[dict[str, Any]], results: list[RequestResult], knobs: DeploymentKnobs,
                   settle_s: float | None) -> dict[str, Any]:
    mins = {"Ingress": knobs.ingress_min_replicas, "Assembler": knobs.assembler_min_replicas}
    maxs = {"Ingress": knobs.ingress_max_replicas, "Assembler": knobs.assembler_max_replicas}
    c = Counter(outcome(r) for r in results)
    deps: dict[str, Any] = {}
    for d in DEPLOYMENTS:
        running = [(row["t"], row[d].get("RUNNING", 0)) for row in rows if row[d]]
        peak = max((n for _, n in running), default=0)
        first_up = next((t for t, n in running if n > mins[d]), None)
        back = None
        if first_up is not None:
            back = next((t for t, n in running if t > first_up and n == mins[d]
                         and all(n2 == mins[d] for t2, n2 in running if t2 >= t)), None)
        deps[d] = {"min": mins[d], "max": maxs[d], "initial": running[0][1] if running else None, "peak": peak,
                   "final": running[-1][1] if running else None, "first_scale_up_t": first_up,
                   "back_at_min_t": back}
    failed = [r for r in results if outcome(r) == "failed"]
    checks = []
    for d in DEPLOYMENTS:
        checks.append(check(f"{d} peak replicas > min ({mins[d]})", float(deps[d]["peak"]), ">=", mins[d] + 1))
        final = deps[d]["final"]
        checks.append(check(f"{d} final replicas == min ({mins[d]})", None if final is None else float(final),
                            "<=", mins[d]))
    checks.append(check("failed requests", float(len(failed)), "<=", 0))
    return {"requests": {"total": len(results), "ok": c["ok"], "failed": c["failed"], "refused": c["refused"],
                         "error_codes": dict(Counter(r.error_code or f"http_{r.status}" for r in results if not r.ok))},
            "deployments": deps, "settle_s": None if settle_s is None else round(settle_s, 1), "checks": checks}


def timeline_table(rows: list[dict[str, Any]], every_s: float) -> str:
    """Rows every ``every_s`` seconds, plus each row where a replica count changed."""
    shown: list[list[Any]] = []
    last_key: tuple[str, ...] | None = None
    next_t = -math.inf
    for i, row in enumerate(rows):
        key = tuple(replica_cell(row[d]) for d in DEPLOYMENTS)
        if key != last_key or row["t"] >= next_t or i == len(rows) - 1:
            shown.append([f"{row['t']:.0f}", row["clients"], row["in_flight"], *key, row["ok"], row["failed"],
                          row["refused"]])
            if row["t"] >= next_t:
                next_t = (math.floor(row["t"] / every_s) + 1) * every_s
            last_key = key
    return table(["t (s)", "clients", "in flight", "Ingress", "Assembler", "ok", "failed", "refused"], shown)


def plot(rows: list[dict[str, Any]], out: Path) -> Path | None:
    series: dict[str, list[tuple[float, float | None]]] = {
        "clients": [(r["t"], float(r["clients"])) for r in rows],
        "in flight": [(r["t"], float(r["in_flight"])) for r in rows],
    }
    for d in DEPLOYMENTS:
        series[f"{d} replicas (running)"] = [(r["t"], float(r[d].get("RUNNING", 0)) if r[d] else None) for r in rows]
    return plot_lines(out / "ramp.png", "Serve autoscaling under a load ramp", "seconds since the load started",
                      "count", series)
