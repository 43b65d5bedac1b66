"""Draining (POST /admin/drain; the run command sends it on SIGTERM), gateway and scheduler
in-process: no new admissions, /ready 503, requests in flight finish within the grace period, and
a stream still open at its end is ended with an error event and [DONE] — never cut."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.local_router import LocalRouter, start_local_router
from tests.support.ray_env import ADMIN_TOKEN

CHAT = "/v1/chat/completions"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def router(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalRouter]:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    r = await start_local_router({
        "admission": {"mode": "open"},
        "sim": {"engines": [{"name": "slow", "role": "unified", "tpot_base_s": 0.02, "tpot_per_running_s": 0.0,
                             "eos_prob": 0.0}]},
    })
    yield r
    await r.stop()


def body(tokens: int, stream: bool = True) -> dict[str, object]:
    return {"model": "narwhal-sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": tokens,
            "stream": stream}


async def _stream(c: httpx.AsyncClient, tokens: int, started: asyncio.Event) -> list[str]:
    events: list[str] = []
    async with c.stream("POST", CHAT, json=body(tokens)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events


async def test_drain_refuses_new_work_lets_short_work_finish_and_ends_long_streams(router: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        s_short, s_long = asyncio.Event(), asyncio.Event()
        short = asyncio.create_task(_stream(c, 20, s_short))  # ~0.4 s: done within the grace
        long = asyncio.create_task(_stream(c, 1000, s_long))  # ~20 s: still open at its end
        plain = asyncio.create_task(c.post(CHAT, json=body(20, stream=False)))
        await asyncio.wait_for(asyncio.gather(s_short.wait(), s_long.wait()), 10)
        assert (await c.post("/admin/drain", json={"grace_s": 1.5})).status_code == 401  # the admin token
        r = await c.post("/admin/drain", json={"grace_s": 1.5}, headers=ADMIN)
        assert r.status_code == 200, r.text
        ready = await c.get("/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        refused = await c.post(CHAT, json=body(4, stream=False))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "router_unavailable" and "draining" in refused.json()["error"]["message"]
        done = await asyncio.wait_for(short, 10)
        assert done[-1] == "[DONE]" and not any('"error"' in e for e in done)
        assert (await asyncio.wait_for(plain, 10)).status_code == 200
        cut = await asyncio.wait_for(long, 10)  # ended ~1.5 s after the drain, not after 20 s
        assert cut[-1] == "[DONE]"
        err = json.loads(cut[-2])["error"]
        assert err["code"] == "router_draining"
        assert 2 < len(cut) < 900  # it streamed tokens first, and did not run to the end
        await router.app_reporter.flush()
    snap = router.svc.snapshot()
    by = {(x["outcome"], x["reason"]): x["count"] for x in snap["counters_by_reason"]}
    assert by == {("completed", ""): 2, ("failed", "router_draining"): 1, ("rejected", "router_unavailable"): 1}, by
    assert snap["gauges"]["retained"] == 0 and snap["state"] == "draining"


async def test_drain_grace_is_checked(router: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        for bad in ({"grace_s": -1}, {"grace_s": "soon"}, {"grace_s": True}):
            r = await c.post("/admin/drain", json=bad, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] == "grace_s"
        assert (await c.get("/ready")).status_code == 200  # still serving
