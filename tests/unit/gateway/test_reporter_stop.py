"""A replica's stop lets a report already on its way reach the scheduler (found by a read-only
review of the admission bookkeeping; failed before its fix): the ingress's shutdown flushes for at
most 2 s, then stops its reporter, which cancelled a report a busy scheduler had not answered yet —
its counters and releases, in no other report, were lost with the replica."""

from __future__ import annotations

import asyncio
from typing import Any

from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.protocol.outcomes import Outcome


async def test_a_report_on_its_way_at_a_stop_still_arrives() -> None:
    got: list[Any] = []
    answer = asyncio.Event()

    async def send(rep: Any) -> None:  # a busy scheduler: it answers after the stop's flush gave up
        await answer.wait()
        got.append(rep)

    r = Reporter(send, linger_s=0)
    r.offered()
    r.release("t1", Outcome.COMPLETED, "", None)
    await r.flush(timeout_s=0.1)
    assert not got
    stopping = asyncio.ensure_future(r.stop())
    await asyncio.sleep(0.05)
    answer.set()
    await asyncio.wait_for(stopping, 5)
    assert len(got) == 1 and got[0].counters.offered == 1 and len(got[0].released) == 1


async def test_a_stop_waits_for_it_only_so_long(monkeypatch: Any) -> None:
    from narwhal_serve.gateway import reporter as module

    monkeypatch.setattr(module, "STOP_SEND_S", 0.1)

    async def never(rep: Any) -> None:
        await asyncio.sleep(3600)

    r = Reporter(never, linger_s=0)
    r.offered()
    await r.flush(timeout_s=0.05)
    await asyncio.wait_for(r.stop(), 2)  # (bounded: an unreachable scheduler does not hold the stop)
    assert r._in_flight is not None and not r._in_flight.done()
    r._in_flight.cancel()
