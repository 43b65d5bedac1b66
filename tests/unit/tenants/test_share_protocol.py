"""The share protocol's edges between a lease and the scheduler (found by a hostile review): a
tenant's last request ending is reported, a forgotten lease owes its output debt only, a client
told to wait is admitted when it comes back even after the leases spent their shares, a give-back
is applied once whichever way it arrives, a promise used by a request refused later is put back."""

from __future__ import annotations

import pytest

from narwhal_serve.admission.core import Ask, Placement
from narwhal_serve.admission.retry import retry_count
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.messages import AdmitRequest
from narwhal_serve.tenants.amounts import Amounts, request_cost
from narwhal_serve.tenants.messages import TenantPart
from tests.unit.tenants.test_global_budget import Ingress, holding_share, service

STATS = RelayStats("chat", ("u",), 0.1, 0, 0.1, 1)


async def test_a_tenant_s_last_request_ending_is_reported_and_frees_its_slot() -> None:
    svc, clock = service(max_concurrent=4)
    ing = await holding_share(svc, clock, "L")
    tid = "L-local"
    assert isinstance(ing.lease.try_admit(tid, Ask(10, 5.0, tenant="acme"), clock() + 60, clock(), clock.t), Placement)
    ing.sync()
    st = svc.tenants.states["acme"]
    assert st.lease_in_use == {"L": 1}
    ing.lease.release(tid, 0)
    ing.sync()
    assert st.lease_in_use == {"L": 0} and st.free_slots() + st.held["L"].concurrent == 4


def test_a_forgotten_lease_owes_its_output_debt_only() -> None:
    svc, clock = service(output_tokens_per_minute=6000)
    st = svc.tenants.state("acme", clock())
    assert st is not None
    before = st.level.output_tokens
    part = TenantPart(spent={"acme": Amounts(output_tokens=150)}, returned={"acme": Amounts(output_tokens=-50)})
    svc.tenants.lease_report("gone", part, clock(), fresh=True)
    assert before - st.level.output_tokens == pytest.approx(50)


async def test_a_client_told_to_wait_is_admitted_when_it_comes_back_after_the_leases_spent_their_shares() -> None:
    svc, clock = service(requests_per_minute=120)
    a, b = Ingress(svc, clock, "A"), Ingress(svc, clock, "B")
    for ing in (a, b):
        ing.sync()
    assert await a.request() and await b.request()
    for _ in range(2):
        for ing in (a, b):
            ing.sync()
    st = svc.tenants.states["acme"]
    n = 0
    while st.available().requests >= 1:  # the rest of the bucket goes to requests the scheduler decides
        n += 1
        assert (await svc.admit(AdmitRequest.of(f"x{n}", clock() + 60, Ask(50, 5.0, tenant="acme")))).error is None
    for ing in (a, b):  # plain clients spend the leases' shares (their views: no promise yet)
        for k in range(5):
            tid = f"{ing.lease.lease_id}-p{k}"
            if isinstance(ing.lease.try_admit(tid, Ask(50, 5.0, tenant="acme"), clock() + 60, clock(), clock.t), Placement):
                ing.lease.release(tid, 0)
    ask = Ask(50, 5.0, tenant="acme", reserves=True, fingerprint="sdk")
    assert a.lease.try_admit("sdk-0", ask, clock() + 60, clock(), clock.t) is None
    r = await a.defer("sdk-0", ask)
    assert r.error is not None and "on requests per minute" in r.error.message
    wait = int(dict(r.error.extra_headers)["retry-after-ms"]) / 1000
    end = clock.t + wait
    while clock.t + 0.1 <= end:
        clock.t += 0.1
        for ing in (a, b):
            ing.sync()
    clock.t = end
    again = Ask(50, 5.0, tenant="acme", reserves=True, retry=True, fingerprint="sdk")
    assert a.lease.try_admit("sdk-1", again, clock() + 60, clock(), clock.t) is None  # promises: the scheduler's
    r = await a.defer("sdk-1", again)
    assert r.error is None


async def test_a_give_back_is_applied_once_whichever_way_it_comes() -> None:
    svc, clock = service(requests_per_minute=600)
    ing = await holding_share(svc, clock, "L")
    st = svc.tenants.states["acme"]
    shares = ing.lease.shares
    assert shares is not None and shares.held["acme"].requests > 0
    total = st.remaining().requests
    back = shares.give_back("acme")
    req = AdmitRequest.of("t-1", clock() + 60, Ask(10, 5.0, tenant="acme"), lease_id="L", lease_epoch=ing.lease.epoch,
                          tenant_returned=back)
    assert (await svc.admit(req)).error is None  # applied with the call (and one request taken)
    shares.give_again("t-1", "acme", back)  # as if the call had failed at the ingress after all
    ing.sync()
    assert st.remaining().requests == pytest.approx(total - 1)  # not returned twice
    back2 = shares.give_back("acme")
    shares.give_again("t-2", "acme", back2)  # a call that never reached the scheduler
    ing.sync()
    assert st.remaining().requests == pytest.approx(total - 1)  # nothing lost either


async def test_a_promise_used_by_a_request_refused_later_is_put_back() -> None:
    svc, clock = service(requests_per_minute=60)
    for i in range(60):
        assert svc.tenants.check("acme", request_cost(10), clock()) is None
    r = svc.tenants.check("acme", request_cost(10), clock(), fingerprint="fp", reserves=True)
    assert r is not None and r.retry_after_s == pytest.approx(1.0)
    clock.t += 1.0
    assert svc.tenants.check("acme", request_cost(10), clock(), fingerprint="fp", reserves=True) is None
    taken = svc.tenants.last_taken
    assert taken is not None and not svc.tenants.states["acme"].promises.by_id
    svc.tenants.refund("acme", request_cost(10), clock(), taken)  # refused for TTFT, say: its place is kept
    assert svc.tenants.check("acme", request_cost(10), clock(), fingerprint="other", reserves=True) is not None
    assert svc.tenants.check("acme", request_cost(10), clock(), fingerprint="fp", reserves=True) is None


def test_a_retry_count_is_ascii_digits_only() -> None:
    assert retry_count("2") == 2 and retry_count(" 0 ") == 0
    for bad in ("²", "٣", "-1", "1e3", "99999", "", None):
        assert retry_count(bad) is None, bad


async def test_a_client_one_request_at_a_time_is_never_over_its_concurrency() -> None:
    """(Found by a hostile probe.) ``max_concurrent: 1``, a client that sends its next request when
    the last one ended: the lease had freed the slot and its report was on the way, but the admit
    call it made for the next request was judged on the report before (one in flight): refused
    "on concurrent requests". The call carries the lease's own count now."""
    from narwhal_serve.scheduler.messages import Report

    svc, clock = service(max_concurrent=1)
    ing = Ingress(svc, clock, "L")
    ing.sync()
    st = svc.tenants.states.get("acme")
    for n in range(4):
        tid = f"L-{n}"
        ask = Ask(10, 5.0, tenant="acme")
        v = ing.lease.try_admit(tid, ask, clock() + 60, clock(), clock.t)
        if v is None:
            assert (await ing.defer(tid, ask)).error is None, n
        else:
            assert isinstance(v, Placement), v
        ing.sync()  # its report: one in flight
        st = svc.tenants.states["acme"]
        assert sum(st.lease_in_use.values()) + st.in_use == 1
        if v is None:
            svc.report(Report(released=[(tid, STATS, True)]))  # (the scheduler admitted it: its end reported)
        ing.lease.release(tid, 0)  # it ended; the next report is cut and on its way, not yet read
        part = ing.lease.cut(clock.t)
        clock.t += 0.01
        nxt, nask = f"L-{n}-next", Ask(10, 5.0, tenant="acme")
        v2 = ing.lease.try_admit(nxt, nask, clock() + 60, clock(), clock.t)
        if v2 is None:
            r = await ing.defer(nxt, nask)
            assert r.error is None, r.error
            svc.report(Report(released=[(nxt, STATS, True)]))
        else:
            assert isinstance(v2, Placement)
            ing.lease.release(nxt, 0)
        grant = svc.report(Report(lease=part))
        assert grant is not None
        ing.lease.apply(grant, clock(), clock.t)

