"""``narwhal-bench goodput --tenants``: the tenant scenarios (docs/contract.md, "Tenants"), each run on
``narwhal-predictive`` (no tenants: two clients sharing the fleet first come, first served, no
``X-Priority``) and ``narwhal-tenants`` (tenants ``a`` and ``b`` with keys, equal weights, priority
classes), side by side, with their rounds rotated.  Rates are fractions of the calibrated SLO
capacity:

* ``noisy-neighbour``: tenant ``a`` at 2×, tenant ``b`` at 0.3×: ``b``'s goodput over its offered
  rate, and its SLO attainment;
* ``fairness``: ``a`` at 2×, ``b`` at 1× (both over their half): Jain's index over the goodputs;
* ``priority``: ``a`` at 0.5× as ``interactive``, ``b`` at 3× as ``batch``: the interactive TTFT p99
  and the total goodput over capacity;
* ``budget`` (``narwhal-tenants-3``: the same tenants, three ingress replicas; ``--budget-s`` long):
  tenant ``c``, limited to ``BUDGET_RPM`` requests per minute, at 10× that, through the three replicas,
  every client an SDK client (``X-Stainless-Retry-Count``, one retry after ``retry-after-ms``):
  the requests admitted against the bucket bound (limit + rate × the time they span), and the share
  of retries that came back when told and were admitted.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from narwhal_serve.bench.client import RetryPolicy, make_session, run_open_loop
from narwhal_serve.bench.fleet import BUDGET_RPM
from narwhal_serve.bench.fleet import TENANT_KEYS as KEYS
from narwhal_serve.bench.goodput import GoodputArgs, GoodputRun
from narwhal_serve.bench.progress import Progress
from narwhal_serve.bench.report import check
from narwhal_serve.bench.stats import ratio, summarize
from narwhal_serve.bench.workload import arrival_times

BASELINE, TENANTS, TENANTS3 = "narwhal-predictive", "narwhal-tenants", "narwhal-tenants-3"
# scenario → ((tenant, priority class or None, fraction of capacity), ...)
SCENARIOS: dict[str, tuple[tuple[str, str | None, float], ...]] = {
    "noisy-neighbour": (("a", None, 2.0), ("b", None, 0.3)),
    "fairness": (("a", None, 2.0), ("b", None, 1.0)),
    "priority": (("a", "interactive", 0.5), ("b", "batch", 3.0)),
}


def jain(values: list[float]) -> float | None:
    """Jain's fairness index: 1 when all are equal, 1/n when one takes everything."""
    if not values or not any(values):
        return None
    return round(sum(values) ** 2 / (len(values) * sum(v * v for v in values)), 4)


async def _scenario(run: GoodputRun, target: str, name: str, capacity: float, seed: int) -> dict[str, Any]:
    a = run.a
    await run._prepare()
    loops = []
    async with make_session() as session:
        with Progress(f"tenants {name} {target}") as prog:
            for i, (tenant, klass, frac) in enumerate(SCENARIOS[name]):
                headers = [("Authorization", f"Bearer {KEYS[tenant]}")]
                if klass is not None and target != BASELINE:  # the baseline: the router without classes
                    headers.append(("X-Priority", klass))
                shape = replace(run.shape, extra_headers=run.shape.extra_headers + tuple(headers))
                times = arrival_times(a.arrival, frac * capacity, a.duration_s, np.random.default_rng([a.seed, seed, i]),
                                      burst_size=a.burst_size)
                specs = a.workload.specs(times, seed_offset=seed * 10 + i)
                loops.append(run_open_loop(session, run.fleet.endpoints[target], shape, specs, drain_s=a.drain_s,
                                           retry=RetryPolicy(0, 0.0, seed), progress=prog))
            results = await asyncio.gather(*loops)
    per: dict[str, Any] = {}
    for (tenant, klass, frac), rs in zip(SCENARIOS[name], results):
        run._log({"phase": f"tenants-{name}", "target": target, "tenant": tenant}, rs)
        s = summarize(rs, a.slo, duration_s=a.duration_s)
        per[tenant] = {"class": klass, "load": frac, "offered_rps": round(frac * capacity, 3), "offered": s["offered"],
                       "goodput_rps": s["goodput_rps"],
                       # of the requests it sent (Poisson arrivals: not exactly rate × window)
                       "goodput_vs_offered": ratio(s["good"], s["offered"]),
                       "slo_attainment_admitted": s["slo_attainment_admitted"], "refusal_rate": s["refusal_rate"],
                       "ttft_p99_ms": s["ttft_ms"]["p99"], "error_codes": s["error_codes"]}
    total = sum(p["goodput_rps"] for p in per.values())
    return {"scenario": name, "target": target, "tenants": per, "goodput_rps": round(total, 3),
            "goodput_vs_capacity": ratio(total, capacity), "jain": jain([p["goodput_rps"] for p in per.values()])}


async def _budget(run: GoodputRun, seconds: float, seed: int) -> dict[str, Any]:
    a = run.a
    await run._prepare()
    rate = 10 * BUDGET_RPM / 60.0
    times = arrival_times("poisson", rate, seconds, np.random.default_rng([a.seed, seed]))
    specs = a.workload.specs(times, seed_offset=seed)
    shape = replace(run.shape, extra_headers=run.shape.extra_headers + (("Authorization", f"Bearer {KEYS['c']}"),))
    async with make_session() as session:
        with Progress(f"tenants budget {TENANTS3} {rate:.1f} rps", total=len(specs)) as prog:
            rs = await run_open_loop(session, run.fleet.endpoints[TENANTS3], shape, specs, drain_s=a.drain_s,
                                     retry=RetryPolicy(10**9, 1.0, seed), progress=prog)
    run._log({"phase": "tenants-budget", "target": TENANTS3, "tenant": "c"}, rs)
    admitted = sorted(r.sent for r in rs if r.admitted)
    span = admitted[-1] - admitted[0] if len(admitted) > 1 else 0.0
    bound = BUDGET_RPM + BUDGET_RPM / 60.0 * span
    retries = [r for r in rs if r.retry_of is not None]
    firsts = [r for r in rs if r.retry_of is None]
    return {"scenario": "budget", "target": TENANTS3, "requests_per_minute": BUDGET_RPM, "offered": len(firsts),
            "offered_rps": round(rate, 3), "admitted": len(admitted), "span_s": round(span, 1), "bound": round(bound, 1),
            # (the span is the client's send times: the router's own clock may differ by milliseconds)
            "overshoot": round(len(admitted) - bound, 2), "refused_first_tries": sum(r.refused for r in firsts),
            "retries": len(retries), "retries_admitted": sum(r.admitted for r in retries),
            "retry_admitted_share": ratio(sum(r.admitted for r in retries), len(retries)),
            "error_codes": dict(Counter(r.error_code for r in rs if r.error_code))}


def tenant_checks(rows: list[dict[str, Any]], slo_ttft_ms: float) -> list[dict[str, Any]]:
    by = {(r["scenario"], r["target"]): r for r in rows}
    out = []
    if (r := by.get(("budget", TENANTS3))) is not None:
        out.append(check("budget: admitted over the bucket bound (requests; < 1: none)", r["overshoot"], "<", 1.0))
        out.append(check("budget: retries after retry-after-ms admitted", r["retry_admitted_share"], ">=", 0.95))
    if (r := by.get(("noisy-neighbour", TENANTS))) is not None:
        b = r["tenants"]["b"]
        out.append(check("noisy neighbour: b's goodput / b's offered", b["goodput_vs_offered"], ">=", 0.95))
        out.append(check("noisy neighbour: b admitted within SLO", b["slo_attainment_admitted"], ">=", 0.99))
    if (r := by.get(("fairness", TENANTS))) is not None:
        out.append(check("fairness: Jain's index over goodput", r["jain"], ">=", 0.95))
    if (r := by.get(("priority", TENANTS))) is not None:
        out.append(check("priority: interactive TTFT p99 (ms)", r["tenants"]["a"]["ttft_p99_ms"], "<=", slo_ttft_ms))
        out.append(check("priority: total goodput / capacity", r["goodput_vs_capacity"], ">=", 0.9))
    return out


async def run_tenant_scenarios(a: GoodputArgs, run: GoodputRun, budget_s: float = 60.0) -> dict[str, Any]:
    cal = await run.calibrate()
    capacity = float(cal["capacity_rps"] or 0.0)
    if capacity <= 0:
        raise RuntimeError(f"could not estimate SLO capacity: {cal}")
    plain = run.shape
    run.shape = replace(plain, extra_headers=plain.extra_headers + (("Authorization", f"Bearer {KEYS['a']}"),))
    for t in (BASELINE, TENANTS, *([TENANTS3] if budget_s > 0 else [])):  # (the baseline has no keys: it ignores the header)
        if a.warmup_s > 0:
            await run.open_run(t, "warmup", 0.3 * capacity, 999, duration_s=a.warmup_s)
    run.shape = plain
    rows = []
    for i, name in enumerate(SCENARIOS):
        order = [BASELINE, TENANTS] if i % 2 == 0 else [TENANTS, BASELINE]
        for t in order:
            rows.append(await _scenario(run, t, name, capacity, 200 + i))
    budget = [await _budget(run, budget_s, 300)] if budget_s > 0 else []
    return {"capacity": cal, "rows": [], "tenant_rows": rows, "budget_rows": budget,
            "checks": tenant_checks(rows + budget, a.slo.ttft_s * 1000), "_log": run.log}
