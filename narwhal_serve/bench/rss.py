"""The memory of a run's processes (``narwhal-bench soak``): each process's role — a replica, Serve's
own actors, HAProxy, Ray's daemons (reported, never judged) — its resident memory sampled over the
run, and the growth from a settled baseline to the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from narwhal_serve.bench import procs
from narwhal_serve.bench.report import table

APP = "narwhal"  # the application whose replicas are judged
RAY_ROLE_PREFIX = "ray "  # roles of Ray's own processes: reported, never judged


def role_for(label: str, app: str = APP, supervisor: bool = False) -> str:
    """The role of a process of the run from its :func:`procs.process_label` (the Ray actor title,
    e.g. ``ray::ServeReplica:narwhal:Ingress``, or the program). Ray's own processes get the
    ``"ray "`` prefix: reported, not judged."""
    if supervisor:
        return "supervisor (serve_run.py)"
    replica = f"ray::ServeReplica:{app}:"
    if label.startswith(replica):
        return "replica " + label[len(replica):]
    named = {"ray::ServeController": "Serve controller", "ray::ProxyActor": "Serve proxy actor",
             "ray::HAProxyManager": "Serve HAProxy manager", "haproxy": "HAProxy", "serve run": "serve run (driver)"}
    if label in named:
        return named[label]
    return RAY_ROLE_PREFIX + (label[5:] if label.startswith("ray::") else label)


def judged(role: str) -> bool:
    return not role.startswith(RAY_ROLE_PREFIX)


def sample_processes(root: int, app: str = APP) -> list[tuple[int, str, int]]:
    """``(pid, role, rss kB)`` of ``root`` and its live descendants."""
    out = []
    for pid in [root, *procs.descendants(root)]:
        kb = procs.rss_kb(pid)
        if kb is not None:
            out.append((pid, role_for(procs.process_label(pid), app, supervisor=pid == root), kb))
    return out


def group_roles(rows: Sequence[tuple[int, str, int]]) -> dict[str, dict[str, Any]]:
    """``{role: {"rss_kb": sum, "n": processes, "pids": [...]}}``."""
    out: dict[str, dict[str, Any]] = {}
    for pid, role, kb in rows:
        g = out.setdefault(role, {"rss_kb": 0, "n": 0, "pids": []})
        g["rss_kb"] += kb
        g["n"] += 1
        g["pids"].append(pid)
    return out


def mb(kb: float | None) -> float | None:
    return None if kb is None else round(kb / 1024.0, 1)


def rss_summary(samples: Sequence[dict[str, Any]], baseline_s: float, max_growth_pct: float) -> list[dict[str, Any]]:
    """Per role: processes, PIDs seen, RSS (MB) first / baseline / last / max, growth % from the
    baseline (the role's first sample at or after ``baseline_s``) to the last sample, verdict
    (``ok``, ``GREW``, ``GONE``: not in the last sample; ``info`` for Ray's own; ``n/a``: no baseline)."""
    order: list[str] = []
    for s in samples:
        order += [r for r in s["roles"] if r not in order]
    order = sorted(order, key=lambda r: not judged(r))  # stable: judged roles first, each in order of appearance
    out = []
    for role in order:
        pts = [(float(s["t"]), s["roles"][role]) for s in samples if role in s["roles"]]
        base = next((g for t, g in pts if t >= baseline_s), None)
        last = pts[-1][1]
        growth = None
        if base is not None and base["rss_kb"] > 0:
            growth = round((last["rss_kb"] - base["rss_kb"]) * 100.0 / base["rss_kb"], 2)
        pids = sorted({p for _, g in pts for p in g["pids"]})
        present = bool(samples) and role in samples[-1]["roles"]
        if not judged(role):
            verdict = "info"
        elif not present:
            verdict = "GONE"
        elif growth is None:
            verdict = "n/a"
        else:
            verdict = "GREW" if growth >= max_growth_pct else "ok"
        out.append({"role": role, "judged": judged(role), "procs_min": min(g["n"] for _, g in pts),
                    "procs_max": max(g["n"] for _, g in pts), "pids_seen": len(pids), "pids": pids,
                    "first_mb": mb(pts[0][1]["rss_kb"]), "baseline_mb": mb(base["rss_kb"] if base else None),
                    "baseline_t": next((t for t, _ in pts if t >= baseline_s), None),
                    "last_mb": mb(last["rss_kb"]), "max_mb": mb(max(g["rss_kb"] for _, g in pts)),
                    "growth_pct": growth, "verdict": verdict})
    return out


def rss_table(rows: Sequence[dict[str, Any]]) -> str:
    return table(["role", "procs", "pids seen", "first MB", "baseline MB", "last MB", "max MB", "growth %", "verdict"],
                 [[r["role"], r["procs_min"] if r["procs_min"] == r["procs_max"] else f"{r['procs_min']}-{r['procs_max']}",
                   r["pids_seen"], r["first_mb"], r["baseline_mb"], r["last_mb"], r["max_mb"], r["growth_pct"],
                   r["verdict"]] for r in rows], nd=1)


def rss_timeline(samples: Sequence[dict[str, Any]], roles: Sequence[str], rows: int = 12) -> str:
    """RSS (MB) of ``roles`` and the sum of Ray's own processes at about ``rows`` evenly spread
    samples (the first, the last and the baseline's neighbours included by the spread)."""
    if not samples:
        return "(no samples)"
    step = max(1, round(len(samples) / rows))
    picked = [s for i, s in enumerate(samples) if i % step == 0]
    if picked[-1] is not samples[-1]:
        picked.append(samples[-1])
    body = []
    for s in picked:
        g = s["roles"]
        ray_kb = sum(v["rss_kb"] for k, v in g.items() if not judged(k))
        body.append([f"{s['t']:.0f}", *[mb(g[r]["rss_kb"]) if r in g else None for r in roles], mb(ray_kb)])
    short = [r.replace("replica ", "").replace("Serve ", "").split(" (")[0] for r in roles]
    return table(["t (s)", *short, "ray (sum)"], body, nd=1)
