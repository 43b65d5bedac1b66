"""The budget rules on constructed data (tenants/rules.py, tenants/book.py): token buckets per kind, output debt,
concurrency, requests that never fit, promises that make Retry-After true, rate-limit headers."""

from __future__ import annotations

import pytest

from narwhal_serve.config import TenantSpec
from narwhal_serve.tenants.amounts import request_cost
from narwhal_serve.tenants.book import TenantBook
from narwhal_serve.tenants.rules import BudgetRefusal, budget_error, ratelimit_headers
from narwhal_serve.tenants.amounts import Amounts

T0 = 1000.0


def book(**limits: float) -> TenantBook:
    return TenantBook({"acme": TenantSpec(name="acme", **limits)})  # type: ignore[arg-type]


def check(b: TenantBook, now: float, prompt: int = 10, *, ticket: str = "", reserves: bool = False
          ) -> BudgetRefusal | None:
    return b.check("acme", request_cost(prompt), now, fingerprint=ticket, reserves=reserves)


def test_requests_per_minute_is_a_bucket_and_retry_after_is_when_it_refills() -> None:
    b = book(requests_per_minute=60)
    assert all(check(b, T0) is None for _ in range(60))  # a full bucket: a burst of the limit
    r = check(b, T0)
    assert r is not None and r.kinds == ("requests",)
    assert r.retry_after_s == pytest.approx(1.0)  # 60/min: one more a second
    assert check(b, T0 + 0.5) is not None
    assert check(b, T0 + 1.0) is None
    assert check(b, T0 + 1.0) is not None


def test_input_tokens_are_charged_up_front_and_unknown_tenants_are_not_budgeted() -> None:
    b = book(input_tokens_per_minute=600)
    assert check(b, T0, prompt=500) is None
    r = check(b, T0, prompt=200)
    assert r is not None and r.kinds == ("input_tokens",)
    assert r.retry_after_s == pytest.approx((200 - 100) / 10.0)
    assert b.check("nobody", request_cost(10**6), T0) is None


def test_a_request_larger_than_the_whole_budget_is_told_it_never_fits() -> None:
    b = book(input_tokens_per_minute=100)
    r = check(b, T0, prompt=101)
    assert r is not None and r.retry_after_s is None and r.kinds == ("input_tokens",)
    err = budget_error(r)
    assert (err.status, err.code, err.retry_after) == (429, "rate_limit_exceeded", None)
    assert ("x-should-retry", "false") in err.extra_headers


def test_output_tokens_run_into_debt_and_the_debt_is_paid_before_the_next_request() -> None:
    b = book(output_tokens_per_minute=600)  # 10 tokens/s
    assert check(b, T0) is None
    b.ended("acme", T0 + 1, output_tokens=700, duration_s=1.0, own=True)  # the stream finished: 100 over
    r = check(b, T0 + 1)
    assert r is not None and r.kinds == ("output_tokens",)
    assert r.retry_after_s == pytest.approx((100 + 1) / 10.0)  # a full bucket did not refill: 100 in debt
    assert check(b, T0 + 1 + r.retry_after_s + 0.01) is None


def test_concurrent_requests_are_slots_freed_when_a_request_ends() -> None:
    b = book(max_concurrent=2)
    assert check(b, T0) is None and check(b, T0) is None
    r = check(b, T0)
    assert r is not None and r.kinds == ("concurrent",) and r.retry_after_s is not None
    b.ended("acme", T0 + 3, output_tokens=0, duration_s=3.0, own=True)
    assert check(b, T0 + 3) is None
    b.refund("acme", request_cost(10), T0 + 3)  # a request that never ran gives its slot back
    assert check(b, T0 + 3) is None


def test_refused_clients_that_retry_are_promised_distinct_times_and_each_is_admitted_then() -> None:
    b = book(requests_per_minute=60)
    for _ in range(60):
        assert check(b, T0) is None
    dues = []
    for i in range(20):  # 20 SDK clients refused at once
        r = check(b, T0, ticket=f"r{i}", reserves=True)
        assert r is not None and r.retry_after_s is not None
        dues.append(T0 + r.retry_after_s)
    assert dues == sorted(dues) and dues[-1] - dues[0] == pytest.approx(19.0)  # one a second, in order
    fresh = check(b, T0 + 0.5, reserves=True, ticket="late")  # a newcomer queues behind them all
    assert fresh is not None and fresh.retry_after_s == pytest.approx(20.5)
    assert check(b, T0 + 0.6, ticket="stranger", reserves=True) is not None  # behind them all
    early = check(b, dues[0] - 0.3, ticket="r0", reserves=True)  # back early: told the rest, keeps its place
    assert early is not None and early.retry_after_s == pytest.approx(0.3)
    for i, due in enumerate(dues):  # each comes back at its Retry-After and is admitted
        assert check(b, due, ticket=f"r{i}", reserves=True) is None, i
    assert check(b, dues[-1] + 0.01) is not None  # no one jumped the queue: the newcomer's turn is later
    assert check(b, T0 + 21.0, ticket="late", reserves=True) is None
    assert check(b, T0 + 22.0, ticket="stranger", reserves=True) is None  # one a second, behind "late"


def test_rate_limit_headers_follow_openai_names() -> None:
    spec = TenantSpec(name="acme", requests_per_minute=600, input_tokens_per_minute=60000)
    h = dict(ratelimit_headers(spec, Amounts(requests=300, input_tokens=59000)))
    assert h["x-ratelimit-limit-requests"] == "600" and h["x-ratelimit-remaining-requests"] == "300"
    assert h["x-ratelimit-reset-requests"] == "30s"
    assert h["x-ratelimit-limit-tokens"] == "60000" and h["x-ratelimit-remaining-tokens"] == "59000"
    assert h["x-ratelimit-reset-tokens"] == "1s"
    assert "x-ratelimit-limit-output-tokens" not in h
    r = BudgetRefusal("acme", ("requests",), 0.25, ())
    err = budget_error(r)
    assert err.retry_after == 1 and ("retry-after-ms", "250") in err.extra_headers


def test_a_client_on_time_is_not_held_up_by_an_earlier_promise_whose_client_never_came() -> None:
    b = book(requests_per_minute=60)
    for _ in range(60):
        assert check(b, T0) is None
    first = check(b, T0, ticket="ghost", reserves=True)
    second = check(b, T0, ticket="on-time", reserves=True)
    assert first is not None and second is not None and first.retry_after_s is not None
    assert second.retry_after_s == pytest.approx(first.retry_after_s + 1.0)
    due = T0 + second.retry_after_s  # the ghost never comes back; its room is still in the bucket
    assert check(b, due + 0.01, ticket="on-time", reserves=True) is None
    assert check(b, due + 0.02, ticket="ghost", reserves=True) is None  # (and had it come late, it still fit)


def test_a_budget_without_a_kind_charges_none_of_it() -> None:
    from dataclasses import fields

    from narwhal_serve.tenants.amounts import KINDS
    from narwhal_serve.tenants.rules import limited

    assert KINDS == tuple(f.name for f in fields(Amounts))  # limited() builds Amounts in KINDS' order
    cost = Amounts(requests=1.0, input_tokens=300.0, output_tokens=7.0, concurrent=1.0)
    spec = TenantSpec(name="acme", input_tokens_per_minute=1000, max_concurrent=2)
    assert limited(cost, spec) == Amounts(input_tokens=300.0, concurrent=1.0)
    spec = TenantSpec(name="acme", requests_per_minute=5, output_tokens_per_minute=9)
    assert limited(cost, spec) == Amounts(requests=1.0, output_tokens=7.0)
