"""The bare pass-through proxy over simulator apps (httpx ASGITransport, no sockets)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from narwhal_serve.bench.proxy import create_proxy_app
from narwhal_serve.sim.app import create_app, get_engine
from narwhal_serve.config.sim import SimEngineConfig

BODY = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5,
        "ignore_eos": True}


class ByHost(httpx.AsyncBaseTransport):
    """Dispatch each request to the ASGI app registered for its host."""

    def __init__(self, apps: dict[str, Any]) -> None:
        self.transports = {h: httpx.ASGITransport(app=a) for h, a in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.transports[request.url.host].handle_async_request(request)


def sim(name: str) -> Any:
    return create_app(SimEngineConfig(name=name, prefill_overhead_s=0, tpot_base_s=0, eos_prob=0))


async def proxy_client(apps: dict[str, Any]) -> httpx.AsyncClient:
    app = create_proxy_app([f"http://{h}:1" for h in apps], transport=ByHost(apps))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")


async def test_non_streaming_passes_through() -> None:
    async with await proxy_client({"e0": sim("e0")}) as c:
        r = await c.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json()["usage"]["completion_tokens"] == 5


async def test_streaming_passes_events_through() -> None:
    async with await proxy_client({"e0": sim("e0")}) as c:
        r = await c.post("/v1/completions", json={"model": "narwhal-sim", "prompt": "hello", "max_tokens": 4,
                                                  "stream": True, "ignore_eos": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert sum(1 for d in data[:-1] if json.loads(d)["choices"][0].get("text")) == 4


async def test_round_robin_and_error_status() -> None:
    apps = {"e0": sim("e0"), "e1": sim("e1")}
    async with await proxy_client(apps) as c:
        for _ in range(4):
            assert (await c.post("/v1/chat/completions", json=BODY)).status_code == 200
        bad = await c.post("/v1/chat/completions", json={**BODY, "model": "other"})
        ready = await c.get("/ready")
    assert [get_engine(a).total_requests for a in apps.values()] == [3, 2]  # e0, e1, e0, e1, e0 (bad)
    assert bad.status_code == 404 and "error" in bad.json()
    assert ready.status_code == 200


async def test_unreachable_upstream_is_502() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    app = create_proxy_app(["http://nowhere:1"], transport=httpx.MockTransport(refuse))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
        r = await c.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"


def test_needs_an_upstream() -> None:
    with pytest.raises(ValueError):
        create_proxy_app([])
