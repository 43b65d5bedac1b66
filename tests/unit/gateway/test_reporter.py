import asyncio

from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.scheduler.messages import Report


async def test_events_are_batched_and_flush_waits_for_delivery() -> None:
    got: list[Report] = []

    async def send(rep: Report) -> None:
        got.append(rep)

    r = Reporter(send, linger_s=0.05)
    r.offered()
    r.admission_wait(0.01)
    r.release("t1", Outcome.COMPLETED, "", None)
    await r.flush()
    assert sum(x.counters.offered for x in got) == 1
    assert [t for x in got for t, _, _ in x.released] == ["t1"]
    assert len(got) == 1  # one call carried the request's three events
    await r.stop()


async def test_a_failed_send_keeps_the_report() -> None:
    calls: list[Report] = []
    fail = asyncio.Event()
    fail.set()

    async def send(rep: Report) -> None:
        if fail.is_set():
            fail.clear()
            raise RuntimeError("scheduler restarting")
        calls.append(rep)

    r = Reporter(send, linger_s=0)
    r.offered()
    r.outcome(Outcome.INVALID, "invalid_request")
    await r.flush()
    assert sum(x.counters.offered for x in calls) == 1
    assert sum(x.counters.outcomes[("invalid_requests", "invalid_request")] for x in calls) == 1
    await r.stop()


async def test_health_events_reach_the_scheduler_in_order() -> None:
    from narwhal_serve.relay.messages import EngineFault, EngineWorked

    got: list[Report] = []

    async def send(rep: Report) -> None:
        got.append(rep)

    r = Reporter(send, linger_s=0.01)
    ok, cut = EngineWorked(("e0",)), EngineFault("e0", "error", "stream reset")
    r.engine_health((ok,))
    r.engine_health((cut, EngineWorked(("e1",))))
    await r.flush()
    assert [e for x in got for e in x.health] == [ok, cut, EngineWorked(("e1",))]
    await r.stop()
