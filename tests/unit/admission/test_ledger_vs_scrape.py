"""The router's own ledger is exact and immediate; a scrape only adds what the ledger cannot see.
(Before: a scrape taken during a burst, still saying "running 1" after the burst drained, made an
idle one-slot engine refuse a one-token prompt for about a second.)"""

from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from tests.support.scheduler import scheduler_service


def one_slot_unified() -> tuple[object, object]:
    svc, clock = scheduler_service({"mode": "predictive", "queue_limit": 4, "phase_concurrency": {"prefill": 8, "decode": 8}})
    for name in ("p", "d"):
        svc.deregister_engine(name)
    u = svc.engines["u"]
    u.cfg = u.cfg.model_copy(update={"max_num_seqs": 1})
    u.service_s = 3.0  # a request holds the slot ~3 s: a second one would wait past a 2 s budget
    return svc, clock


async def test_a_stale_scrape_does_not_override_a_drained_ledger() -> None:
    svc, clock = one_slot_unified()
    u = svc.engines["u"]  # type: ignore[attr-defined]
    first = await svc.admit(AdmitRequest("a", clock.t + 60, 1, 4, 2.0))  # type: ignore[attr-defined]
    assert first.error is None
    # the scrape arrives while "a" runs: the engine reports it, and so does the ledger
    u.load, u.inflight_at_scrape = EngineLoad(running=1), u.inflight
    assert u.external() == 0 and u.in_flight() == 1
    svc.report(Report(released=[("a", None, False)]))  # type: ignore[attr-defined]
    assert u.in_flight() == 0  # the scrape (still "running 1") is older than the release
    again = await svc.admit(AdmitRequest("b", clock.t + 60, 1, 4, 2.0))  # type: ignore[attr-defined]
    assert again.error is None, again.error


async def test_requests_from_other_clients_still_count() -> None:
    svc, clock = one_slot_unified()
    u = svc.engines["u"]  # type: ignore[attr-defined]
    u.load, u.inflight_at_scrape = EngineLoad(running=1), 0  # someone else's request holds the slot
    assert u.in_flight() == 1
    r = await svc.admit(AdmitRequest("c", clock.t + 60, 1, 4, 2.0))  # type: ignore[attr-defined]
    assert r.error is not None and r.error.code == "ttft_budget_exceeded"
