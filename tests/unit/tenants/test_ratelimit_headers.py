"""Differential review of the per-tenant rate-limit headers and Retry-After against OpenAI's semantics
and what clients do with them (openai-python, openai-node, LiteLLM, the cookbook).  Each test here
failed, before its fix, because of the problem its docstring names."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from narwhal_serve.config import TenantSpec
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult
from narwhal_serve.tenants.amounts import Amounts, request_cost
from narwhal_serve.tenants.book import TenantBook
from narwhal_serve.tenants.messages import TenantFacts
from narwhal_serve.tenants.rules import budget_error, ratelimit_headers
from narwhal_serve.tenants.shares import LeaseShares
from tests.unit.gateway.test_sdk_semantics import CHAT, MODEL, _answer, _app, _asgi_post, _Scripted

T0 = 1000.0

# OpenAI's reset values are Go durations ("20ms", "1.5s", "6m0s", "1h2m3s"); parsed as go-openai does
# (time.ParseDuration), for the forms OpenAI emits.
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def go_duration(text: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Go duration: {text!r}"
    return sum(float(n) * _UNIT[u] for n, u in parts)


# OpenAI clients read these and only these (LiteLLM litellm/types/utils.py OPENAI_RESPONSE_HEADERS).
OPENAI_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                  "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


def test_an_empty_bucket_resets_in_one_minute_not_one_minute_and_a_second() -> None:
    """Finding 1: ``(cap - left) / (cap / 60)`` is 60.00000000000001 for about a quarter of the integer
    limits (11, 21, 22, ... per minute) and ``_duration`` rounds it *up* to whole seconds: an empty
    bucket is said to be full again in ``1m1s``, one second later than it is (contract: "when the
    bucket is full again")."""
    for rpm in (11, 21, 35, 77):
        spec = TenantSpec(name="acme", requests_per_minute=rpm)
        h = dict(ratelimit_headers(spec, Amounts(requests=0)))
        assert go_duration(h["x-ratelimit-reset-requests"]) == pytest.approx(60.0, abs=0.001), (rpm, h)


def test_the_seconds_form_of_reset_is_never_earlier_than_the_bucket_is_full() -> None:
    """Finding 2: below a minute the reset is written with ``:.3g`` (round to nearest), so 12.44 s
    becomes ``12.4s``: a client that waits the reset and then spends the whole bucket is refused.
    The millisecond and minute forms round up; the seconds form must too."""
    spec = TenantSpec(name="acme", requests_per_minute=600)  # 10 a second
    left = 600 - 124.4  # 124.4 requests short: full in 12.44 s
    h = dict(ratelimit_headers(spec, Amounts(requests=left)))
    assert go_duration(h["x-ratelimit-reset-requests"]) >= 12.44, h["x-ratelimit-reset-requests"]


def test_the_output_token_reset_counts_the_debt() -> None:
    """Finding 3: a tenant in output-token debt has ``remaining`` clamped to 0 and the reset computed
    from the clamped value, so it never says more than ``1m0s``; 300 tokens in debt on a 600/min
    budget is full again in 90 s (contract: reset is "when the bucket is full again")."""
    spec = TenantSpec(name="acme", output_tokens_per_minute=600)
    h = dict(ratelimit_headers(spec, Amounts(output_tokens=-300)))
    assert h["x-ratelimit-remaining-output-tokens"] == "0"
    assert go_duration(h["x-ratelimit-reset-output-tokens"]) == pytest.approx(90.0, abs=0.01)


def test_a_429_for_output_tokens_shows_it_on_a_header_openai_clients_read() -> None:
    """Finding 4: the output budget is only on ``x-ratelimit-*-output-tokens``, which no OpenAI client
    reads (LiteLLM copies only OPENAI_RESPONSE_HEADERS: -requests and -tokens).  A tenant refused for
    its output tokens gets a 429 whose every OpenAI header says there is room and the bucket is
    (nearly) full, so header-driven clients come straight back."""
    spec = TenantSpec(name="acme", requests_per_minute=600, input_tokens_per_minute=60000,
                      output_tokens_per_minute=6000)
    b = TenantBook({"acme": spec})
    assert b.check("acme", request_cost(10), T0) is None
    b.ended("acme", T0 + 1, output_tokens=7000, duration_s=1.0, own=True)  # a stream ran 1,000 over
    r = b.check("acme", request_cost(10), T0 + 1)
    assert r is not None and r.kinds == ("output_tokens",) and r.retry_after_s is not None
    h = dict(budget_error(r).extra_headers)
    seen = {k: h[k] for k in OPENAI_HEADERS if k in h}
    exhausted = seen.get("x-ratelimit-remaining-requests") == "0" or seen.get("x-ratelimit-remaining-tokens") == "0"
    assert exhausted, seen


def test_a_tenant_budgeted_on_output_tokens_only_has_openai_token_headers() -> None:
    """Finding 4 (second face): with ``output_tokens_per_minute`` alone, the answers carry no
    ``x-ratelimit-*-tokens`` at all: an OpenAI client sees no token budget."""
    spec = TenantSpec(name="acme", output_tokens_per_minute=6000)
    h = dict(ratelimit_headers(spec, Amounts(output_tokens=100)))
    assert "x-ratelimit-remaining-tokens" in h and "x-ratelimit-limit-tokens" in h, h


def test_a_requests_per_minute_below_one_is_refused_or_can_admit_a_request() -> None:
    """Finding 5: ``requests_per_minute`` is a float ``gt=0``; 0.5 (one request every two minutes) is
    accepted, but the bucket holds at most 0.5 and every request costs 1: each one is a 429
    "Request too large" with ``x-should-retry: false`` (never admitted), and the headers say
    ``x-ratelimit-limit-requests: 0``."""
    try:
        spec = TenantSpec(name="acme", requests_per_minute=0.5)
    except ValidationError:
        return  # refused where it is configured: fine
    b = TenantBook({"acme": spec})
    r = b.check("acme", request_cost(10), T0)
    assert r is None or r.retry_after_s is not None, (r, dict(budget_error(r).extra_headers))


def test_a_request_admitted_from_the_lease_share_is_counted_in_its_own_remaining() -> None:
    """Finding 7: an answer admitted from a lease's share carries ``remaining`` as the scheduler last
    reported it, without the request just taken (nor any taken since): after one request of a full
    600/min bucket it still says 600 remaining and a reset of ``0ms`` (OpenAI counts the request)."""
    spec = TenantSpec(name="acme", requests_per_minute=600)
    shares = LeaseShares({"acme": spec})
    shares.facts = {"acme": TenantFacts("acme", Amounts(requests=600.0), T0, False, 1.0)}
    shares.held = {"acme": Amounts(requests=10.0)}
    assert shares.check("acme", request_cost(10), T0, retry=False, reserves=False) is True
    shares.take("t1", "acme", request_cost(10))
    remaining = shares.remaining("acme", T0)
    assert remaining is not None
    h = dict(ratelimit_headers(spec, remaining))
    assert int(h["x-ratelimit-remaining-requests"]) <= 599, h


async def test_without_ingress_leases_an_error_answer_to_a_budgeted_tenant_carries_the_headers() -> None:
    """Finding 8: docs/contract.md, "Tenants": "Every answer to a budgeted tenant carries OpenAI's
    x-ratelimit-*".  ``_with_limits`` reads the remaining budget only from the ingress lease's shares;
    with ``admission.ingress_leases: false`` (a supported setting) there are none, so an error answer
    (here a malformed body, after the tenant was identified) carries no headers, although this
    replica was told the tenant's remaining budget with the answer just before."""
    key = "sk-review-acme"

    async def answers(placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        yield RelayMessage(first_token=True, engines=("u0",))
        yield RelayMessage(data=json.dumps(_answer()).encode(), final=True)

    class Budgeted(_Scripted):
        async def admit(self, req: AdmitRequest) -> AdmitResult:
            ok = await super().admit(req)
            return AdmitResult(candidates=ok.candidates, remaining=Amounts(requests=599.0))

    app = _app(Budgeted(answers), tenants={"list": [{"name": "acme", "requests_per_minute": 600,
                                                      "key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}]})
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    status, headers, _ = await _asgi_post(app, CHAT, body, auth)
    assert status == 200 and headers.get("x-ratelimit-remaining-requests") == "599", headers
    status, headers, writes = await _asgi_post(app, CHAT, {**body, "messages": "not a list"}, auth)
    assert status == 400, b"".join(writes)
    assert headers.get("x-ratelimit-limit-requests") == "600", headers
    await app.state.reporter.stop()  # (no lifespan runs here)
