"""A tenant's budget holds for the whole router, whatever the number of ingress leases: three
leases and the scheduler (no Ray, a virtual clock) under 5 minutes of 10× demand admit no more
than the bucket bound (limit + rate × time), and most of it; shares go back when a tenant goes quiet
or gets promises; output debt taken at one lease stops new requests at the others."""

from __future__ import annotations

import hashlib

import pytest

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.admission.core import Ask, Placement
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report
from narwhal_serve.scheduler.service import SchedulerService
from narwhal_serve.tenants.shares import LeaseShares
from tests.support.scheduler import Clock, scheduler_service

RPM, TPM, PROMPT = 120.0, 6000.0, 50


def service(**limits: float) -> tuple[SchedulerService, Clock]:
    tenants = {"list": [{"name": "acme", "key_sha256": [hashlib.sha256(b"k").hexdigest()], **limits},
                        {"name": "free"}]}
    return scheduler_service({"mode": "open", "queue_limit": 0, "phase_concurrency": {"prefill": 512, "decode": 512}},
                             {"http_retention_limit": 1024}, tenants=tenants)


class Ingress:
    """One ingress replica: its lease, and the scheduler call when the lease defers."""

    def __init__(self, svc: SchedulerService, clock: Clock, name: str) -> None:
        self.svc, self.clock = svc, clock
        self.lease = AdmissionLease(name, shares=LeaseShares(svc.cfg.tenants.by_name()))  # type: ignore[union-attr]
        self.n = 0
        self.scheduler_calls = 0

    def sync(self) -> None:
        for e in self.svc.engines.values():  # (their scrapes, by hand)
            e.last_ok = self.clock.t
        part = self.lease.cut(self.clock.t)
        grant = self.svc.report(Report(lease=part))
        assert grant is not None
        self.lease.apply(grant, self.clock(), self.clock.t)

    async def defer(self, tid: str, ask: Ask) -> AdmitResult:
        """The admit call the gateway makes when the lease defers: the lease's share of the tenant
        handed back with it."""
        assert self.lease.shares is not None
        return await self.svc.admit(AdmitRequest.of(tid, self.clock() + 60, ask, lease_id=self.lease.lease_id,
                                                    lease_epoch=self.lease.epoch,
                                                    tenant_returned=self.lease.shares.give_back(ask.tenant)))

    async def request(self, tenant: str = "acme", prompt: int = PROMPT, output: int = 0) -> bool:
        self.n += 1
        tid = f"{self.lease.lease_id}-{self.n}"
        ask = Ask(prompt, 5.0, tenant=tenant)
        v = self.lease.try_admit(tid, ask, self.clock() + 60, self.clock(), self.clock.t)
        if isinstance(v, Refusal):
            return False
        stats = RelayStats("chat", ("u",), 0.1, output, 0.1, 1)
        if isinstance(v, Placement):
            self.lease.release(tid, output)
            self.svc.report(Report(released=[(tid, stats, True)]))
            return True
        self.scheduler_calls += 1
        res = await self.defer(tid, ask)
        if res.error is not None:
            assert res.error.code == "rate_limit_exceeded", res.error
            return False
        self.svc.report(Report(released=[(tid, stats, True)]))
        return True


async def holding_share(svc: SchedulerService, clock: Clock, name: str) -> Ingress:
    """An ingress whose lease holds a share of acme: one request (through the scheduler: no share
    yet, the tenant seen), then two reports (the grant, then the share in the lease's view)."""
    ing = Ingress(svc, clock, name)
    ing.sync()
    assert await ing.request()
    ing.sync()
    ing.sync()
    return ing


@pytest.mark.parametrize("replicas", [1, 3])
async def test_three_leases_under_ten_times_demand_never_pass_the_bucket_bound(replicas: int) -> None:
    svc, clock = service(requests_per_minute=RPM, input_tokens_per_minute=TPM)
    ingresses = [Ingress(svc, clock, f"i{k}") for k in range(replicas)]
    seconds, dt = 300.0, 0.1
    demand = 10 * TPM / PROMPT / 60.0  # requests a second: 10× what the binding (input) budget allows
    admitted = offered = 0
    carry = 0.0
    for step in range(int(seconds / dt)):
        clock.t += dt
        for ing in ingresses:
            ing.sync()
        carry += demand * dt
        while carry >= 1.0:
            carry -= 1.0
            offered += 1
            admitted += await ingresses[offered % replicas].request()
        # another tenant without budgets is never limited, and never limits acme
        assert await ingresses[step % replicas].request("free", prompt=10**5)
    bound = min(RPM + RPM / 60 * seconds, (TPM + TPM / 60 * seconds) / PROMPT)
    assert admitted <= bound  # exact: no overshoot of requests or input tokens
    assert admitted >= 0.9 * bound, (admitted, bound)  # and the budget is used, not starved
    # most requests were decided under the leases, not by a scheduler call
    served_locally = offered + int(seconds / dt) - sum(i.scheduler_calls for i in ingresses)
    assert served_locally > 0.5 * (offered + int(seconds / dt))


async def test_output_debt_at_one_lease_stops_new_requests_at_the_others() -> None:
    svc, clock = service(output_tokens_per_minute=600)
    a, b = Ingress(svc, clock, "a"), Ingress(svc, clock, "b")
    for ing in (a, b, a, b):
        ing.sync()
    assert await a.request(output=0)
    assert await b.request(output=0)
    for ing in (a, b):
        ing.sync()
    assert await a.request(output=2000)  # a long answer: the stream is never cut for its tokens
    for _ in range(2):
        a.sync()
        b.sync()
    assert not await b.request()  # the tenant is in debt router-wide
    clock.t += (2000 - 600) / 10.0 + 5  # the debt refilled (10 tokens/s)
    for _ in range(2):
        a.sync()
        b.sync()
    assert await b.request()


async def test_a_quiet_tenant_s_shares_go_back_to_the_bucket() -> None:
    svc, clock = service(requests_per_minute=60)
    ing = await holding_share(svc, clock, "i")
    st = svc.tenants.states["acme"]
    assert st.held.get("i") is not None and st.held["i"].requests > 0
    clock.t += 11.0  # past ACTIVE_S without a request from acme at this lease
    ing.sync()
    ing.sync()
    assert st.held["i"].requests == pytest.approx(0.0)
    assert st.remaining().requests == pytest.approx(60.0)


async def test_clients_that_wait_their_retry_after_are_admitted() -> None:
    """SDK clients (they send X-Stainless-Retry-Count) at 10× the tenant's budget for two minutes,
    through three leases: each refused client comes back when its Retry-After says and resends the
    same body; at least 95 % of those returns are admitted, and the budget bound still holds."""
    import heapq

    svc, clock = service(requests_per_minute=RPM)
    ingresses = [Ingress(svc, clock, f"i{k}") for k in range(3)]
    rate = 10 * RPM / 60.0
    start = clock.t
    events: list[tuple[float, int, int]] = []  # (when, client, attempt)
    for n in range(int(rate * 120)):
        heapq.heappush(events, (start + n / rate, n, 0))
    returns = admitted_on_return = admitted = 0
    dt = 0.05
    while events:
        clock.t += dt
        for ing in ingresses:
            ing.sync()
        while events and events[0][0] <= clock.t:
            _, client, attempt = heapq.heappop(events)
            ing = ingresses[client % 3]
            ask = Ask(PROMPT, 5.0, tenant="acme", retry=attempt > 0, reserves=True, fingerprint=f"c{client}")
            tid = f"c{client}-{attempt}"
            v = ing.lease.try_admit(tid, ask, clock.t + 60, clock.t, clock.t)
            assert not isinstance(v, Refusal)  # a client that retries is refused by the scheduler (with a promise)
            if isinstance(v, Placement):  # within the lease's share
                admitted += 1
                admitted_on_return += attempt > 0
                returns += attempt > 0
                ing.lease.release(tid, 0)
                continue
            res = await ing.defer(tid, ask)
            ok = res.error is None
            returns += attempt > 0
            admitted_on_return += ok and attempt > 0
            if ok:
                admitted += 1
                svc.report(Report(released=[(tid, RelayStats("chat", ("u",), 0.1, 0, 0.1, 1), True)]))
                continue
            assert res.error is not None and res.error.code == "rate_limit_exceeded"
            retry_after = next(int(v) for k, v in res.error.extra_headers if k == "retry-after-ms") / 1000
            if attempt < 5:
                heapq.heappush(events, (clock.t + retry_after, client, attempt + 1))
    elapsed = clock.t - start
    assert admitted <= RPM + RPM / 60 * elapsed
    assert returns > 1000 and admitted_on_return >= 0.95 * returns, (admitted_on_return, returns)
