"""The router's own request headers sent twice with different values are a 400 naming the header
(found by a hostile probe of the run mode: the first value won silently, so a client's
``X-TTFT-Target`` overrode one an intermediary appended, and the request log kept the first
``X-Request-Id``); the same value twice is taken."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.requests import Request

from narwhal_serve.errors import InvalidRequest
from narwhal_serve.gateway.body import header
from tests.support.local_router import LocalRouter, start_local_router

MODEL = "narwhal-sim"


def _req(*pairs: tuple[str, str]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/",
                    "headers": [(k.encode(), v.encode()) for k, v in pairs]})


def test_one_value_twice_is_that_value_and_two_are_refused() -> None:
    assert header(_req(("x-ttft-target", "2"), ("x-ttft-target", "2")), "x-ttft-target") == "2"
    assert header(_req(), "x-ttft-target") is None
    with pytest.raises(InvalidRequest) as err:
        header(_req(("x-ttft-target", "0.001"), ("x-ttft-target", "60")), "x-ttft-target")
    assert err.value.info().param == "x-ttft-target"


@pytest.fixture(scope="module")
async def router() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({"admission": {"mode": "predictive"}, "sim": {"engines": [{"name": "u0"}]}})
    yield r
    await r.stop()


@pytest.mark.parametrize("name,a,b", [("X-TTFT-Target", "0.001", "60"), ("X-Request-Id", "aaa", "bbb"),
                                      ("X-Priority", "interactive", "batch"), ("X-Request-Timeout", "5", "9"),
                                      ("X-Stainless-Retry-Count", "0", "1")])
async def test_conflicting_copies_are_a_400_in_the_envelope(router: LocalRouter, name: str, a: str, b: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=body, headers=[(name, a), (name, b)])
        same = await c.post("/v1/chat/completions", json=body, headers=[(name, a), (name, a)]) \
            if name not in ("X-TTFT-Target", "X-Priority") else None
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name.lower() and err["code"] == "invalid_request", err
    assert same is None or same.status_code == 200, same.text
