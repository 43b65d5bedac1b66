"""Tenants over HTTP, the router in-process (no Ray): 401 for missing and unknown keys (counted, the
key never logged), OpenAI's rate-limit headers on answers and refusals, 429 rate_limit_exceeded with
a Retry-After the official ``openai`` client honours, per-tenant series in /metrics."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.support.local_router import LocalRouter, start_local_router

CHAT = "/v1/chat/completions"
KEYS = {"acme": "sk-acme-secret-1", "slow": "sk-slow-secret-2", "free": "sk-free-secret-3", "bulk": "sk-bulk-4"}


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


@pytest.fixture(scope="module")
async def router() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({
        "admission": {"mode": "open"},
        "sim": {"engines": [{"name": "u", "role": "unified", "priority_scheduling": True}], "kv_events": False},
        "tenants": {"list": [
            {"name": "acme", "key_sha256": [sha(KEYS["acme"])], "requests_per_minute": 600},
            {"name": "slow", "key_sha256": [sha(KEYS["slow"])], "requests_per_minute": 60},
            {"name": "free", "key_sha256": [sha(KEYS["free"])]},
            {"name": "bulk", "key_sha256": [sha(KEYS["bulk"])], "default_class": "batch", "max_class": "standard"},
        ]},
    })
    yield r
    await r.stop()


def chat(**kw: object) -> dict[str, object]:
    return {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


async def test_missing_and_unknown_keys_get_401_counted_and_never_logged(router: LocalRouter,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        missing = await c.post(CHAT, json=chat())
        unknown = await c.post(CHAT, json=chat(), headers={"Authorization": "Bearer sk-nobody-knows-this"})
        await router.app_reporter.flush()
        metrics = (await c.get("/metrics")).text
    for r in (missing, unknown):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"  # (RFC 9110: the scheme it asks for)
    assert 'narwhal_invalid_requests_total{reason="invalid_api_key"}' in metrics
    line = next(ln for ln in metrics.splitlines() if ln.startswith('narwhal_invalid_requests_total{reason="invalid_api_key"}'))
    assert int(line.split()[-1]) >= 2
    assert "sk-nobody-knows-this" not in caplog.text
    assert not router.sim("u").engine.recent or all(
        "sk-nobody" not in json.dumps(x) for x in router.sim("u").engine.recent)


async def test_answers_carry_openai_rate_limit_headers(router: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        for _ in range(3):  # the first may be decided by the scheduler, the next ones under the lease
            r = await c.post(CHAT, json=chat(), headers=auth("acme"))
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "600"
            assert 0 <= int(r.headers["x-ratelimit-remaining-requests"]) < 600
            assert r.headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))
        free = await c.post(CHAT, json=chat(), headers=auth("free"))
        # (found by a hostile probe) an admission refusal is an answer to the tenant too
        long = {"model": "narwhal-sim", "prompt": [1 + i % 2000 for i in range(5000)], "max_tokens": 3}  # past the 4,096 context
        refused = await c.post("/v1/completions", json=long, headers=auth("acme"))
    assert free.status_code == 200 and "x-ratelimit-limit-requests" not in free.headers
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded", refused.text
    assert refused.headers["x-ratelimit-limit-requests"] == "600"


async def test_over_budget_gets_429_with_a_retry_after_the_openai_client_honours(router: LocalRouter) -> None:
    # made before the bucket is drained: its first try must come while the bucket is still empty
    # (made after, on a busy machine, it could come after the refill and not be refused at all)
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=KEYS["slow"], max_retries=2)
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        # another tenant's answers, for the per-tenant series below (this test alone makes them)
        assert [(await c.post(CHAT, json=chat(), headers=auth("acme"))).status_code for _ in range(3)] == [200] * 3
        codes = [(await c.post(CHAT, json=chat(), headers=auth("slow"))).status_code for _ in range(60)]
        assert codes.count(200) >= 55  # the bucket's burst (its refill adds one a second)
        while True:  # drain what refilled meanwhile, until the next request is over half a second away
            over = await c.post(CHAT, json=chat(), headers=auth("slow"))
            if over.status_code == 429 and int(over.headers["retry-after-ms"]) >= 600:
                break
            if over.status_code == 429:
                await asyncio.sleep(int(over.headers["retry-after-ms"]) / 1000 + 0.01)
    assert over.status_code == 429
    err = over.json()["error"]
    assert (err["code"], err["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert over.headers["x-narwhal-reason"] == "rate_limit_exceeded"
    assert 1 <= int(over.headers["retry-after"]) <= 2 and 0 < int(over.headers["retry-after-ms"]) <= 1100
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    # the official client: refused, it waits retry-after-ms and is admitted on its retry
    t0 = time.monotonic()
    raw = await client.chat.completions.with_raw_response.create(model="narwhal-sim", messages=[{"role": "user", "content": "hi"}],
                                                                 max_tokens=3)
    waited = time.monotonic() - t0
    assert raw.http_response.status_code == 200 and raw.retries_taken >= 1
    assert waited >= 0.5  # it waited for the refill it was told of
    assert raw.headers["x-ratelimit-limit-requests"] == "60"
    await client.close()
    await router.app_reporter.flush()
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        metrics = (await c.get("/metrics")).text
        status = (await c.get("/status")).json()
    assert 'narwhal_rejected_total{reason="rate_limit_exceeded"}' in metrics
    rejected = next(ln for ln in metrics.splitlines()
                    if ln.startswith('narwhal_tenant_requests_total{tenant="slow",outcome="rejected"}'))
    assert int(rejected.split()[-1]) >= 2
    assert 'narwhal_tenant_budget_remaining{tenant="slow",budget="requests"}' in metrics
    assert 'narwhal_tenant_tokens_total{tenant="acme",kind="output"}' in metrics
    rows = {r["tenant"]: r for r in status["tenants"]}
    assert rows["slow"]["outcomes"]["rejected"] >= 2 and rows["acme"]["admitted"] >= 3


async def test_priority_classes_reach_the_engine_lowered_to_the_tenant_s_ceiling(router: LocalRouter) -> None:
    cases = [("acme", None, 1), ("acme", "interactive", 0), ("acme", "Batch", 2),
             ("bulk", None, 2), ("bulk", "interactive", 1)]  # bulk: default batch, at most standard
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        for i, (tenant, header, want) in enumerate(cases):
            rid = f"prio-{i}"
            headers = {**auth(tenant), "X-Request-Id": rid, **({"X-Priority": header} if header else {})}
            r = await c.post(CHAT, json=chat(), headers=headers)
            assert r.status_code == 200, r.text
            sent = next(x for x in router.sim("u").engine.recent if x["request_id"] == rid)
            assert sent["body"]["priority"] == want, (tenant, header)
        bad = await c.post(CHAT, json=chat(), headers={**auth("acme"), "X-Priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-priority"
        await router.app_reporter.flush()
        metrics = (await c.get("/metrics")).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith('narwhal_class_requests_total{class="batch",outcome="completed"}'))
    assert int(line.split()[-1]) >= 2
    assert 'narwhal_class_goodput_total{class="interactive"}' in metrics


@pytest.mark.parametrize("cap", [1, 2])
async def test_a_client_one_request_at_a_time_is_never_over_its_concurrent_limit(cap: int) -> None:
    """(Found by a hostile probe.) ``max_concurrent`` 1 (and 2, beside a long stream of the same
    tenant): a client sending its next request as its last one ended got 429 "on concurrent
    requests" 7 times in 12 — the lease refused on the count its last grant showed, and the
    scheduler judged on a report older than the end. Now the lease leaves a lacking slot to the
    scheduler, and the scheduler hears what ended first."""
    r = await start_local_router({
        "admission": {"mode": "open"},
        "sim": {"engines": [{"name": "u", "role": "unified", "tpot_base_s": 0.01, "eos_prob": 0.0}], "kv_events": False},
        "tenants": {"list": [{"name": "acme", "key_sha256": [sha(KEYS["acme"])], "max_concurrent": cap}]},
    })
    try:
        async with httpx.AsyncClient(base_url=r.url, timeout=30) as c:
            long: asyncio.Task[httpx.Response] | None = None
            if cap == 2:  # one slot held throughout
                long = asyncio.create_task(c.post(CHAT, json=chat(max_tokens=400), headers=auth("acme")))
                for _ in range(500):  # (bounded: until it holds its slot)
                    await asyncio.sleep(0.01)
                    if r.svc.snapshot()["gauges"]["decode_inflight"] == 1:
                        break
            codes = [(await c.post(CHAT, json=chat(max_tokens=2), headers=auth("acme"))).status_code for _ in range(12)]
            assert codes == [200] * 12, codes
            if long is not None:
                assert (await long).status_code == 200
            over = await asyncio.gather(*(c.post(CHAT, json=chat(max_tokens=50), headers=auth("acme")) for _ in range(cap + 2)))
            assert sorted(x.status_code for x in over).count(429) >= 1  # (still a limit: more at once is refused)
    finally:
        await r.stop()
