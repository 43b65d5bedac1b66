"""``narwhal-bench decision``: the admission decision's own cost, no servers.

A scheduler with N engines (half unified, the rest prefill/decode pairs) marked healthy, and one
ingress :class:`~narwhal_serve.admission.lease.AdmissionLease` synced with it. Times, per request:
a lease admission (``try_admit``: view with its own changes, routes, projections, judgement,
permits) and its release, and the scheduler's own ``decide`` on its view (what a fallback admit
call runs). With ``tenants``, that many budgeted tenants (lease shares, fair-share weights), the
requests round-robin over them. Pure CPU; prints percentiles and writes JSON.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from narwhal_serve.admission.core import Ask, decide
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.bench.stats import percentile
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.scheduler.messages import Report
from narwhal_serve.scheduler.service import SchedulerService
from narwhal_serve.tenants.amounts import request_cost
from narwhal_serve.tenants.shares import LeaseShares

BIG = 10**9


def _service(engines: int, tenants: int = 0) -> SchedulerService:
    specs = []
    for i in range(engines):
        role = "unified" if i % 2 == 0 else ("prefill" if i % 4 == 1 else "decode")
        specs.append({"name": f"e{i}", "url": f"http://127.0.0.1:{10000 + i}", "role": role})
    cfg = NarwhalConfig.model_validate({
        "serving": {"http_retention_limit": BIG},
        "admission": {"mode": "predictive", "queue_limit": BIG, "phase_concurrency": {"prefill": BIG, "decode": BIG}},
        "engines": specs,
        **({"tenants": {"list": [{"name": f"t{k}", "requests_per_minute": BIG, "input_tokens_per_minute": BIG,
                                  "output_tokens_per_minute": BIG, "max_concurrent": BIG, "weight": 1 + k % 3}
                                 for k in range(tenants)]}} if tenants else {}),
    })
    svc = SchedulerService(cfg, clock=lambda: 1000.0)
    for e in svc.engines.values():
        e.healthy, e.last_ok = True, 1000.0
        e.context, e.context_asked = 32768, 1000.0  # as a vLLM engine says it on its /v1/models
    svc.router.started = True
    svc.ha.last_pass = 1000.0  # a monitor pass just made (its verdict is part of every scheduler decision)
    return svc


def _pct(xs: list[float]) -> dict[str, float]:
    """p50 / p99 in µs, linear-interpolated as every other figure of the benchmarks (until
    2026-12-07 the rank above: p99 of 100 samples was their maximum, p50 the upper middle one)."""
    p50, p99 = percentile(xs, 50), percentile(xs, 99)
    assert p50 is not None and p99 is not None, "no samples"
    return {"p50_us": round(p50 * 1e6, 1), "p99_us": round(p99 * 1e6, 1)}


def measure(engines: int, requests: int, tenants: int = 0) -> dict[str, object]:
    svc = _service(engines, tenants)
    lease = AdmissionLease("bench")
    if svc.cfg.tenants is not None:
        lease.shares = LeaseShares(svc.cfg.tenants.by_name())

    def sync() -> None:
        grant = svc.report(Report(lease=lease.cut(0.0)))
        if grant is not None:
            lease.apply(grant, 1000.0, 0.0)

    # as in an ingress replica, which knows its Ray node (the engines here are by URL: none is near)
    # (sized exactly, as by the router's tokenizer: the context row is judged)
    asks = [Ask(prompt_tokens=200, ttft_budget_s=60.0, tenant=f"t{k}", node="bench-node", exact=True)
            for k in range(max(1, tenants))]
    if lease.shares is not None:
        for ask in asks:  # every tenant seen at the lease and its bucket started: the next grants carry shares
            lease.shares.check(ask.tenant, request_cost(200), 1000.0, retry=False, reserves=False)
            svc.tenants.check(ask.tenant, request_cost(200), 1000.0)
    sync()
    sync()
    local: list[float] = []
    deferred = 0
    for i in range(requests):
        ask = asks[i % len(asks)]
        t0 = time.perf_counter()
        v = lease.try_admit(f"t{i}", ask, 2000.0, 1000.0, 0.0)
        local.append(time.perf_counter() - t0)
        deferred += v is None
        lease.release(f"t{i}", 10)
        if i % 100 == 99:  # a report every ~100 requests, as under load (every ~5 ms)
            sync()
    central: list[float] = []
    for i in range(requests):
        t0 = time.perf_counter()
        decide(svc.decision_view(1000.0), asks[i % len(asks)], 1000.0, i)
        central.append(time.perf_counter() - t0)
    return {"engines": engines, "tenants": tenants, "requests": requests, "lease_admission": _pct(local),
            "deferred_to_scheduler": deferred, "scheduler_decide": _pct(central)}


def run(out_dir: Path, engines: list[int], requests: int, tenants: list[int] | None = None) -> list[dict[str, object]]:
    rows = [measure(n, requests, t) for n in engines for t in (tenants or [0])]
    print(f"{'engines':>8} {'tenants':>8} {'lease admit p50/p99 (µs)':>26} {'scheduler decide p50/p99 (µs)':>31}")
    for r in rows:
        la, sd = r["lease_admission"], r["scheduler_decide"]
        assert isinstance(la, dict) and isinstance(sd, dict)
        print(f"{r['engines']:>8} {r['tenants']:>8} {la['p50_us']:>12} / {la['p99_us']:<11} "
              f"{sd['p50_us']:>14} / {sd['p99_us']:<14}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(rows, indent=1))
    return rows
