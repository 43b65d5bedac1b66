"""Every offered request ends in exactly one counted outcome, also where admission itself is
interrupted (found by a read-only review of the admission bookkeeping; both failed before their
fix): a client that leaves while its tenant's admission waits for the reporter's flush (counted
offered, never ended), and a fault in the router's own admission code (an uncounted 500)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from typing import Any

import pytest
from starlette.requests import Request

from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.gateway.completion import CompletionHandler
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from narwhal_serve.tenants.shares import LeaseShares

KEY = "sk-acme-1"
CFG = NarwhalConfig.model_validate({
    "sim": {"engines": [{"name": "u", "role": "unified"}]},
    "tenants": {"list": [{"name": "acme", "key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                          "max_concurrent": 2}]}})


class SlowScheduler:
    """A scheduler slow to answer reports (one is on its way when the request comes)."""

    local_relay = None

    def __init__(self) -> None:
        self.sent: list[Report] = []

    async def report(self, rep: Report) -> None:
        self.sent.append(rep)
        await asyncio.sleep(3600)

    async def admit(self, req: Any) -> Any:
        raise AssertionError("not reached in these tests")

    async def cancel(self, ticket_id: str) -> None:
        return None


def request(gone: asyncio.Event) -> Request:
    body = json.dumps({"model": CFG.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if msgs:
            return msgs.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    return Request(scope, receive)


def tally(sched: SlowScheduler, rep: Reporter) -> tuple[int, dict[Any, int]]:
    reports = [*sched.sent, rep._pending]
    outcomes: Counter[Any] = Counter()
    for r in reports:
        outcomes.update(r.counters.outcomes)
    return sum(r.counters.offered for r in reports), dict(outcomes)


def handler() -> tuple[CompletionHandler, Reporter, SlowScheduler]:
    sched = SlowScheduler()
    lease = AdmissionLease("ingress-t")
    lease.shares = LeaseShares(CFG.tenants.by_name() if CFG.tenants is not None else {})
    rep = Reporter(sched.report, lease=lease, linger_s=0)
    return CompletionHandler(CFG, sched, rep), rep, sched  # type: ignore[arg-type]


async def test_a_client_leaving_while_its_tenants_admission_waits_for_a_flush_is_counted() -> None:
    h, rep, sched = handler()
    rep._ends = 1  # a request of this replica ended; the scheduler has not heard yet (its tenant slots)
    gone = asyncio.Event()
    task = asyncio.create_task(h.handle(request(gone), "chat"))
    for _ in range(200):  # until the flush's report is on its way (the request waits on it)
        if sched.sent:
            break
        await asyncio.sleep(0.01)
    assert sched.sent and not task.done()
    gone.set()  # the client leaves
    resp = await task
    await rep.stop()
    assert resp.status_code == 499
    offered, outcomes = tally(sched, rep)
    assert offered == 1 and sum(outcomes.values()) == 1, (offered, outcomes)


async def test_a_fault_in_admission_is_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    h, rep, sched = handler()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(AdmitRequest, "of", broken)
    with pytest.raises(RuntimeError):  # (gateway/app.py answers it 500)
        await h.handle(request(asyncio.Event()), "chat")
    await rep.stop()
    offered, outcomes = tally(sched, rep)
    assert offered == 1 and sum(outcomes.values()) == 1, (offered, outcomes)
