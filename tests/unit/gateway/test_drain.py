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


def body(tokens: int, stream: bool = True, usage: bool = False) -> dict[str, object]:
    return {"model": "narwhal-sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": tokens,
            "stream": stream, **({"stream_options": {"include_usage": True}} if usage else {})}


async def _stream(c: httpx.AsyncClient, tokens: int, started: asyncio.Event, usage: bool = False) -> list[str]:
    events: list[str] = []
    async with c.stream("POST", CHAT, json=body(tokens, usage=usage)) as r:
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
        long = asyncio.create_task(_stream(c, 1000, s_long, usage=True))  # ~20 s: still open at its end
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
        # (found by a hostile probe) the usage it asked for comes before the error, as on every other
        # failure path: the output tokens identified so far
        usage = json.loads(cut[-3])
        tokens = sum(1 for e in cut[:-3] if json.loads(e)["choices"] and json.loads(e)["choices"][0]["delta"].get("content"))
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == tokens > 0, usage
        assert usage["usage"]["prompt_tokens"] > 0 and usage["id"] == json.loads(cut[0])["id"]
        assert usage["model"] == "narwhal-sim"
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


async def test_an_answer_not_begun_at_the_end_of_the_grace_gets_the_drains_503(router: LocalRouter) -> None:
    """(Found by a hostile probe.) A non-streaming answer still being assembled when the grace
    ended was left to the shutdown, which closed its connection without a response. Now it is
    answered the drain's 503 (``router_draining``, ``Retry-After: 1``: another router takes it),
    counted ``failed``, with nothing held after it."""
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        long = asyncio.create_task(c.post(CHAT, json=body(1000, stream=False)))  # ~20 s of output
        for _ in range(500):  # (bounded: until it is admitted and decoding)
            await asyncio.sleep(0.01)
            if router.svc.snapshot()["gauges"]["decode_inflight"] == 1:
                break
        r = await c.post("/admin/drain", json={"grace_s": 1.0}, headers=ADMIN)
        assert r.status_code == 200, r.text
        answer = await asyncio.wait_for(long, 10)  # at the end of the grace, not after 20 s
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
        assert answer.json()["error"]["code"] == "router_draining"
        await router.app_reporter.flush()
    snap = router.svc.snapshot()
    by = {(x["outcome"], x["reason"]): x["count"] for x in snap["counters_by_reason"]}
    assert by == {("failed", "router_draining"): 1}, by
    assert snap["gauges"]["retained"] == 0 and snap["gauges"]["decode_inflight"] == 0


async def test_requests_queued_when_a_drain_begins_are_answered_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """(Found by a hostile probe.) Requests in the scheduler's queue when the drain began waited
    until a permit freed (1.2-1.7 s) for their 503; now they get it at once, as new ones do, while
    the request holding the permit runs on."""
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    r = await start_local_router({
        "admission": {"mode": "open", "queue_limit": 4, "phase_concurrency": {"prefill": 1, "decode": 8}},
        "sim": {"engines": [{"name": "slow", "role": "unified", "tpot_base_s": 0.02, "eos_prob": 0.0,
                             "prefill_per_token_s": 0.05}]},
    })
    try:
        async with httpx.AsyncClient(base_url=r.url, timeout=30) as c:
            long_prompt = {**body(4, stream=False), "messages": [{"role": "user", "content": "x " * 300}]}
            holder = asyncio.create_task(c.post(CHAT, json=long_prompt))  # its prefill permit: ~15 s
            for _ in range(500):
                await asyncio.sleep(0.01)
                if r.svc.snapshot()["gauges"]["prefill_inflight"] == 1:
                    break
            queued = [asyncio.create_task(c.post(CHAT, json=body(4, stream=False))) for _ in range(2)]
            for _ in range(500):
                await asyncio.sleep(0.01)
                if r.svc.snapshot()["gauges"]["queued"] == 2:
                    break
            assert r.svc.snapshot()["gauges"]["queued"] == 2
            assert (await c.post("/admin/drain", json={"grace_s": 30}, headers=ADMIN)).status_code == 200
            answers = await asyncio.wait_for(asyncio.gather(*queued), 5)
            assert r.svc.snapshot()["gauges"]["prefill_inflight"] == 1  # (they did not wait for its permit)
            for a in answers:
                assert a.status_code == 503 and a.json()["error"]["code"] == "router_unavailable", a.text
                assert a.headers["retry-after"] == "1" and "draining" in a.json()["error"]["message"]
            assert r.svc.snapshot()["gauges"]["queued"] == 0
            holder.cancel()
    finally:
        await r.stop()
