"""The operators' metrics (docs/operations.md, "Metrics", "Dashboard"): admissions, goodput, predicted vs measured
TTFT per engine and per-engine load gauges, from a SchedulerService without HTTP, checked through
``prometheus_client``'s own parser (the text must be valid exposition format)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from narwhal_serve.scheduler.service import SchedulerService
from narwhal_serve.telemetry import Histogram, render_metrics
from tests.support.scheduler import Clock, scheduler_service


def service(mode: str = "predictive", prefill: int = 8) -> tuple[SchedulerService, Clock]:
    return scheduler_service(
        {"mode": mode, "queue_limit": 4, "max_wait_s": 5, "phase_concurrency": {"prefill": prefill, "decode": 8}}
    )


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


async def admit_and_finish(
    svc: SchedulerService, tid: str, ttft: float, budget: float, tokens: int = 5, completed: bool = True
) -> str:
    res = await svc.admit(AdmitRequest(tid, 2000.0, 10, 16, budget))
    assert res.error is None
    route = res.candidates[0]
    svc.report(Report(released=[(tid, RelayStats(route.kind, route.engines, ttft, tokens, 0.01, 1), completed)]))
    return (route.prefill or route.decode).name


async def test_goodput_counts_first_tokens_within_the_request_target() -> None:
    svc, _ = service()
    await admit_and_finish(svc, "fast", ttft=0.05, budget=2.0)
    await admit_and_finish(svc, "slow", ttft=0.5, budget=0.4)  # admitted, but its first token was late
    await admit_and_finish(svc, "edge", ttft=0.3, budget=0.3)
    await admit_and_finish(svc, "broke", ttft=0.05, budget=2.0, completed=False)  # failed after its first token
    res = await svc.admit(AdmitRequest("gone", 2000.0, 10, 16, 2.0))
    assert res.error is None
    svc.report(Report(released=[("gone", None, False)]))  # cancelled before any token: no stats, no goodput
    text = svc.metrics_text()
    assert value(text, "narwhal_admitted_total") == 5
    assert value(text, "narwhal_goodput_total") == 2
    assert svc.snapshot()["served"]["admitted"] == 5 and svc.snapshot()["served"]["goodput"] == 2


async def test_predicted_vs_measured_ttft_per_first_token_engine() -> None:
    svc, _ = service()
    first = [await admit_and_finish(svc, f"t{i}", ttft=0.1 * (i + 1), budget=5.0) for i in range(4)]
    text = svc.metrics_text()
    s = samples(text)
    n = {k[1][0][1]: v for k, v in s.items() if k[0] == "narwhal_engine_ttft_predictions_total"}
    engines = {e["name"] for e in svc.snapshot()["engines"]}
    assert n == {e: first.count(e) for e in engines}  # every engine, at zero where none was first
    measured = sum(v for k, v in s.items() if k[0] == "narwhal_engine_ttft_measured_seconds_total")
    predicted = sum(v for k, v in s.items() if k[0] == "narwhal_engine_ttft_predicted_seconds_total")
    assert abs(measured - (0.1 + 0.2 + 0.3 + 0.4)) < 1e-9
    assert predicted > 0
    assert value(text, "narwhal_ttft_predicted_seconds_count") == 4
    assert abs(value(text, "narwhal_ttft_predicted_seconds_sum") - predicted) < 1e-9
    assert value(text, "narwhal_ttft_prediction_error_seconds_count") == 4


async def test_open_mode_counts_goodput_too_and_a_request_without_first_token_is_not_goodput() -> None:
    svc, _ = service("open")
    await admit_and_finish(svc, "a", ttft=0.05, budget=2.0)
    res = await svc.admit(AdmitRequest("b", 2000.0, 10, 16, 2.0))
    r = res.candidates[0]
    svc.report(Report(released=[("b", RelayStats(r.kind, r.engines, None, 0, 0.0, 1), False)]))
    text = svc.metrics_text()
    assert value(text, "narwhal_admitted_total") == 2 and value(text, "narwhal_goodput_total") == 1


async def test_a_request_granted_from_the_queue_keeps_its_target() -> None:
    svc, _ = service("open", prefill=1)
    first = await svc.admit(AdmitRequest("a", 2000.0, 10, 16, 2.0))
    waiter = asyncio.ensure_future(svc.admit(AdmitRequest("b", 2000.0, 10, 16, 0.25)))
    await asyncio.sleep(0)
    assert svc.admission.gauges()["queued"] == 1
    assert value(svc.metrics_text(), "narwhal_queued_requests") == 1
    svc.report(Report(decode_started=[("a", ())]))  # frees the prefill permit: b is granted
    b = await waiter
    assert first.error is None and b.error is None
    rb = b.candidates[0]
    svc.report(Report(released=[("a", None, False), ("b", RelayStats(rb.kind, rb.engines, 0.3, 3, 0.01, 1), True)]))
    text = svc.metrics_text()
    assert value(text, "narwhal_admitted_total") == 2
    assert value(text, "narwhal_goodput_total") == 0  # 0.3 s against b's own 0.25 s target


def test_placements_carry_the_ttft_target_lease_side_too() -> None:
    svc, clock = service()
    placement = decide(svc.view(clock()), Ask(10, 1.5), clock(), 1)
    assert isinstance(placement, Placement) and placement.ttft_budget_s == 1.5
    lease = AdmissionLease("i1")
    grant = svc.report(Report(lease=lease.cut(0.0)))
    assert grant is not None
    lease.apply(grant, clock(), 0.0)
    local = lease.try_admit("L", Ask(10, 0.75), clock() + 60, clock(), 0.0)
    assert isinstance(local, Placement) and local.ttft_budget_s == 0.75
    svc.report(Report(lease=lease.cut(0.0)))  # the scheduler charges (and counts) the local admission
    r = local.routes[0]
    svc.report(Report(released=[("L", RelayStats(r.kind, r.engines, 0.5, 2, 0.01, 1), True)]))
    text = svc.metrics_text()
    assert value(text, "narwhal_admitted_total") == 1 and value(text, "narwhal_goodput_total") == 1


async def test_per_engine_load_gauges() -> None:
    svc, clock = service()
    svc.engines["u"].load = EngineLoad(running=3, waiting=2, kv_usage=0.5)
    svc.engines["d"].healthy = False
    clock.t += 1.5
    res = await svc.admit(AdmitRequest("x", 2000.0, 123, 16, 2.0))
    assert res.error is None
    first = res.candidates[0].prefill or res.candidates[0].decode
    text = svc.metrics_text()
    assert value(text, "narwhal_engine_running_requests", engine="u") == 3
    assert value(text, "narwhal_engine_waiting_requests", engine="u") == 2
    assert value(text, "narwhal_engine_kv_cache_usage_ratio", engine="u") == 0.5
    assert value(text, "narwhal_engine_healthy", engine="d") == 0 and value(text, "narwhal_engine_healthy", engine="u") == 1
    assert value(text, "narwhal_engine_metrics_age_seconds", engine="p") == 1.5
    assert value(text, "narwhal_engine_pending_prefill_tokens", engine=first.name) == 123
    assert value(text, "narwhal_engine_pending_prefill_requests", engine=first.name) == 1
    for name in res.candidates[0].engines:
        assert value(text, "narwhal_engine_inflight_requests", engine=name) == 1
    svc.report(Report(released=[("x", None, False)]))
    text = svc.metrics_text()
    assert all(value(text, "narwhal_engine_inflight_requests", engine=e) == 0 for e in ("u", "p", "d"))
    assert value(text, "narwhal_engine_pending_prefill_tokens", engine=first.name) == 0


async def test_engine_without_a_scrape_has_no_age_sample() -> None:
    svc, _ = service()
    svc.engines["p"].last_ok = None
    s = samples(svc.metrics_text())
    assert ("narwhal_engine_metrics_age_seconds", (("engine", "p"),)) not in s
    assert ("narwhal_engine_metrics_age_seconds", (("engine", "u"),)) in s


def test_a_snapshot_without_served_figures_renders_zeros() -> None:
    svc, _ = service()
    snap = svc.snapshot()
    del snap["served"]
    hists = {k: Histogram() for k in ("ttft", "tpot", "admission_wait", "ttft_prediction_error")}
    text = render_metrics(snap, hists)
    assert value(text, "narwhal_admitted_total") == 0 and value(text, "narwhal_goodput_total") == 0


def test_a_fresh_router_exports_every_known_family_at_zero() -> None:
    """Dashboards chart a new router, and rate() sees the first increment: every terminal class
    with each of its known reasons, and each engine's fault, probe and TTFT families, at 0."""
    from narwhal_serve.protocol.outcomes import KNOWN_REASONS

    svc, _ = service()
    s = samples(svc.metrics_text())
    for outcome, reasons in KNOWN_REASONS.items():
        for reason in reasons:
            assert s[(f"narwhal_{outcome.value}_total", (("reason", reason),))] == 0, (outcome, reason)
    for e in svc.snapshot()["engines"]:
        name = e["name"]
        for kind in ("error", "timeout", "backpressure"):
            assert s[("narwhal_engine_attempt_faults_total", (("engine", name), ("kind", kind)))] == 0
        for result in ("ok", "failed"):
            assert s[("narwhal_engine_probes_total", (("engine", name), ("result", result)))] == 0
        assert s[("narwhal_engine_ttft_predictions_total", (("engine", name),))] == 0


def test_every_total_is_typed_counter() -> None:
    """A family named ``*_total`` is a counter (what Prometheus' rate() and the naming rules expect),
    whatever list it is rendered from: the per-engine drift-outs count was typed gauge."""
    svc, _ = service()
    typed = [line.split()[2:4] for line in svc.metrics_text().splitlines() if line.startswith("# TYPE ")]
    totals = [(name, kind) for name, kind in typed if name.endswith("_total")]
    assert ("narwhal_engine_drift_outs_total", "counter") in totals
    assert all(kind == "counter" for _, kind in totals), [t for t in totals if t[1] != "counter"]
