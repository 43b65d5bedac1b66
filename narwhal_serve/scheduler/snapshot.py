"""``/status``: the scheduler's whole state as plain JSON (docs/contract.md, "Routes")."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from narwhal_serve.scheduler.service import SchedulerService


def snapshot(svc: "SchedulerService") -> dict[str, Any]:
    now = svc.clock()
    maint = frozenset(svc.router.maintenance)
    ready, reason = svc.readiness()
    return {
        "ready": ready,
        "state": reason,
        "router_mode": svc.router.mode,
        "epoch": svc.ha.epoch() or None,
        "ha": svc.ha.view(),
        "maintenance_waves": sorted(maint),
        "admission_mode": svc.cfg.admission.mode,
        "counters": svc.counters.contract_view(),
        "counters_by_reason": [
            {"outcome": o, "reason": r, "count": n} for (o, r), n in sorted(svc.counters.by_outcome.items())
        ],
        "resumes": [{"reason": r, "outcome": o, "count": n} for (r, o), n in sorted(svc.counters.resumes.items())],
        "gauges": svc.admission.gauges(),
        "served": svc.tally.view(),
        "tenants": svc.tenant_tally.view(svc.counters.by_tenant, svc.tenants.remaining(now)),
        "classes": svc.tenant_tally.class_view(svc.counters.by_class),
        "fair_share": {t: {"measured": round(u, 4), "fair": round(f, 4)} for t, (u, f) in svc.fair.shares(now).items()},
        "output_lengths": [{"route": k, "max_tokens_bucket": b, "mean_tokens": round(m, 2)}
                           for k, b, m in svc.outputs.table()],
        "profiles_sent": svc.profiler.sent,
        "scheduler_calls": dict(svc.calls),
        "admission_leases": [
            {"lease": k, "reserved": asdict(r.reserved), "in_use": asdict(r.in_use),
             "tickets": len(r.tickets), "age_s": round(now - r.last_seen, 3)}
            for k, r in svc.leases.leases.items()
        ],
        "engines": [{**e.view(now, svc.cfg.monitoring.stale_after_s, maint), "kv_events": svc.kv_events.view(name)}
                    for name, e in svc.engines.items()],
    }
