"""A request's TTFT counts from when it reached the router: behind HAProxy, the stamp HAProxy sets on
each request (``x-narwhal-received-us``), so that its wait in HAProxy's and the replica's queues
before the handler is inside the budget it is admitted on and the TTFT it is reported with.  A
request that already waited most of its budget is refused (429 ``ttft_budget_exceeded``) instead of
admitted to miss it; the prompt alone is still judged against the whole budget.  Without HAProxy
(Serve's proxy actor) the header is a client's and is not believed."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request

from narwhal_serve.admission.predictive import judge
from narwhal_serve.gateway.body import received_at
from narwhal_serve.prediction.ttft import Projection
from narwhal_serve.runenv import RECEIVED_HEADER
from tests.support.local_router import TEST_STAMP_KEY, LocalRouter, start_local_router

CHAT = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ARGS = {"sim": {"engines": [{"name": "u0"}]}}


def _request(value: str | None) -> Request:
    headers = [] if value is None else [(RECEIVED_HEADER.encode(), value.encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""})


def test_the_stamp_is_read_within_its_bounds_and_only_with_the_runs_key() -> None:
    now, key = 1_800_000_000.0, TEST_STAMP_KEY

    def at(value: str | None) -> float:
        return received_at(_request(value), now, 60.0, key)

    assert at(None) == now
    assert at(f"{int((now - 1.25) * 1e6)} {key}") == pytest.approx(now - 1.25)
    assert at(f"{int((now + 5) * 1e6)} {key}") == now  # a clock ahead: no wait
    assert at(f"1 {key}") == now - 60.0  # older than any request lives
    for bad in ("", "-5", "1.5", "12 ", "0x10", "9" * 18, str(int((now - 1.25) * 1e6)),  # (no key: a client's)
                f"{int((now - 1.25) * 1e6)} {'f' * 32}", f"{int((now - 1.25) * 1e6)} {key.upper()}",
                f"{int((now - 1.25) * 1e6)}  {key}", f"{int((now - 1.25) * 1e6)} {key} x"):
        assert at(bad) == now, bad


def test_the_wait_counts_against_the_projection_not_the_prompt_alone() -> None:
    p = Projection(prompt_alone_s=0.8, projected_s=0.9)
    assert judge(p, 1.0) is None
    refused = judge(p, 1.0, waited_s=0.5)
    assert refused is not None and refused.reason == "ttft_budget_exceeded"
    assert "less the 0.50 s it has waited since it reached the router by 0.40 s" in refused.error.message
    assert refused.error.retry_after == 1  # (a retry is received anew: the engine's part is under the budget)
    # the prompt alone fits the whole budget: a wait before the router is no reason to say it never will
    waited_out = judge(Projection(prompt_alone_s=0.8, projected_s=0.8), 1.0, waited_s=5.0)
    assert waited_out is not None and waited_out.reason == "ttft_budget_exceeded"
    assert waited_out.error.retry_after == 1  # (overrun 4.8 s, all of it the wait: not what a retry waits for)
    late = judge(Projection(prompt_alone_s=0.5, projected_s=4.2), 1.0, waited_s=0.5)
    assert late is not None and late.error.retry_after == 3  # the projection's own overrun, 3.2 s
    alone = judge(Projection(prompt_alone_s=1.2, projected_s=1.2), 1.0, waited_s=0.5)
    assert alone is not None and alone.reason == "prompt_exceeds_ttft_budget"


@pytest.fixture(scope="module")
async def stamped() -> AsyncIterator[LocalRouter]:
    r = await start_local_router(ARGS, stamped=True)
    yield r
    await r.stop()


@pytest.fixture(scope="module")
async def unstamped() -> AsyncIterator[LocalRouter]:
    r = await start_local_router(ARGS)
    yield r
    await r.stop()


def _stamp(ago_s: float) -> dict[str, str]:
    return {RECEIVED_HEADER: f"{int((time.time() - ago_s) * 1e6)} {TEST_STAMP_KEY}"}


async def test_a_request_that_waited_out_its_budget_is_refused(stamped: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=stamped.url, timeout=10.0) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={**_stamp(1.5), "X-TTFT-Target": "1"})
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "ttft_budget_exceeded" and "it has waited since it reached the router" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        # the same request, fresh, is admitted
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-TTFT-Target": "1"})
        assert r.status_code == 200, r.text


async def test_the_reported_ttft_counts_from_the_stamp(stamped: LocalRouter, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.requests")
    async with httpx.AsyncClient(base_url=stamped.url, timeout=10.0) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={**_stamp(0.4), "X-Request-Id": "stamped-1"})
        assert r.status_code == 200, r.text
    line = next(json.loads(rec.getMessage()) for rec in caplog.records
                if rec.name == "narwhal.requests" and "stamped-1" in rec.getMessage())
    assert line["outcome"] == "completed"
    assert 0.4 <= line["ttft_s"] < 2.0 and 0.4 <= line["admission_wait_s"] < line["ttft_s"]
    assert line["duration_s"] >= line["ttft_s"]


async def test_without_haproxy_a_clients_stamp_is_not_believed(unstamped: LocalRouter,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.requests")
    async with httpx.AsyncClient(base_url=unstamped.url, timeout=10.0) as c:
        r = await c.post("/v1/chat/completions", json=CHAT,
                         headers={**_stamp(30.0), "X-TTFT-Target": "1", "X-Request-Id": "unstamped-1"})
        assert r.status_code == 200, r.text
    line = next(json.loads(rec.getMessage()) for rec in caplog.records
                if rec.name == "narwhal.requests" and "unstamped-1" in rec.getMessage())
    assert line["ttft_s"] < 1.0


def test_the_stamp_is_believed_only_behind_narwhals_haproxy_wrapper(tmp_path: Path) -> None:
    from narwhal_serve.config import ServingConfig
    from narwhal_serve.runenv import STAMPS_ENV, IngressLimits, direct_ingress_env, stamps_receipts

    limits = IngressLimits.of([ServingConfig()])
    env = direct_ingress_env({"RAY_SERVE_ENABLE_HA_PROXY": "1"}, limits, str(tmp_path / "a"))
    key = stamps_receipts(env)
    assert key is not None and env[STAMPS_ENV] == key and len(key) == 32
    # the wrapper stamps with that key: the value is the microseconds and the key
    assert f'set-header x-narwhal-received-us "%[date(0,us)] {key}"' in (tmp_path / "a" / "haproxy").read_text()
    assert direct_ingress_env({"RAY_SERVE_ENABLE_HA_PROXY": "1"}, limits, str(tmp_path / "c"))[STAMPS_ENV] != key
    # an operator's own HAProxy binary: no wrapper, no stamp, and a client's header is not believed
    own = direct_ingress_env({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_BINARY_PATH": "/usr/sbin/haproxy"},
                             limits, str(tmp_path / "b"))
    assert STAMPS_ENV not in own and stamps_receipts(own) is None
    assert stamps_receipts({**env, "RAY_SERVE_ENABLE_HA_PROXY": "0"}) is None  # Serve's proxy actor
    assert stamps_receipts({**env, STAMPS_ENV: "1"}) is None  # not a key


async def test_the_predicted_ttft_counts_from_the_receipt_as_the_ttft_does(stamped: LocalRouter) -> None:
    """``X-Narwhal-Predicted-TTFT`` is comparable with the TTFT a client sees: the wait up to the
    admission plus the projection (a probe saw p50 0.026 s in the header against 1.0 s measured
    under a burst: the header left the wait out)."""
    async with httpx.AsyncClient(base_url=stamped.url, timeout=10.0) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers=_stamp(0.5))
        assert r.status_code == 200, r.text
        assert 0.5 <= float(r.headers["x-narwhal-predicted-ttft"]) < 1.5
        fresh = await c.post("/v1/chat/completions", json=CHAT)
        assert float(fresh.headers["x-narwhal-predicted-ttft"]) < 0.5


async def test_a_stamp_without_the_runs_key_is_not_believed(stamped: LocalRouter) -> None:
    """A client that reaches a replica around HAProxy (Serve's fallback proxy, the replica's own
    port) and writes its own stamp is not believed (a probe's 5 s old stamp got a 429 there)."""
    old = int((time.time() - 5.0) * 1e6)
    async with httpx.AsyncClient(base_url=stamped.url, timeout=10.0) as c:
        for forged in (str(old), f"{old} {'f' * 32}"):
            r = await c.post("/v1/chat/completions", json=CHAT,
                             headers={RECEIVED_HEADER: forged, "X-TTFT-Target": "1"})
            assert r.status_code == 200, (forged, r.text)
            assert float(r.headers["x-narwhal-predicted-ttft"]) < 1.0
