"""Mid-stream resume on the ``pair`` application (docs/contract.md, "Engine failures"): an engine that fails
after the first token — reset, stall, an in-stream 5xx, a malformed chunk, bad token IDs, a restart
— is replaced by the other engine, and the client gets one complete answer: ``[DONE]``, no error
event, and exactly the token IDs of an uninterrupted greedy run, no gap and no repeat.  Each
scenario ends quiescent and counts one offered request and one terminal outcome per request."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest

from tests.fault.conftest import IDLE_TIMEOUT_S, App, Fleet
from tests.fault.helpers import (
    CHAT,
    COMPLETIONS,
    assert_clean_end,
    assert_quiescent,
    delta,
    engine_of,
    engine_set,
    fleet_set,
    timed_post,
    wait_usable,
)
from tests.support.graph import MODEL, chat_body, status


def greedy(stream: bool, max_tokens: int = 12, route: str = "chat") -> dict[str, Any]:
    kw: dict[str, Any] = {"return_token_ids": True, "ignore_eos": True, "temperature": 0,
                          "stream_options": {"include_usage": True} if stream else None}
    if route == "chat":
        return chat_body("resume me exactly", stream=stream, max_tokens=max_tokens, **kw)
    return {"model": MODEL, "prompt": "resume me exactly", "stream": stream, "max_tokens": max_tokens, **kw}


def answer_ids(r: httpx.Response, stream: bool) -> tuple[list[int], dict[str, Any]]:
    """The token IDs of an answer, and its usage."""
    if stream:
        events = assert_clean_end(r)
        ids = [i for e in events if isinstance(e, dict) for c in e.get("choices") or () for i in c.get("token_ids") or ()]
        [usage] = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        return ids, usage
    assert r.status_code == 200, r.text
    out = r.json()
    return list(out["choices"][0]["token_ids"]), out["usage"]


def resumes(snap: dict[str, Any]) -> dict[tuple[str, str], int]:
    return {(r["reason"], r["outcome"]): r["count"] for r in snap["resumes"]}


def resumed_since(before: dict[str, Any], after: dict[str, Any]) -> dict[tuple[str, str], int]:
    old = resumes(before)
    return {k: n - old.get(k, 0) for k, n in resumes(after).items() if n - old.get(k, 0)}


async def reference(app: App, route: str = "chat") -> list[int]:
    path = CHAT if route == "chat" else COMPLETIONS
    r, _ = await timed_post(app, greedy(False, route=route), path=path)
    ids, usage = answer_ids(r, False)
    assert len(ids) == 12 and usage["completion_tokens"] == 12
    return ids


@pytest.mark.parametrize(("fault", "reason"), [
    ("reset_mid_stream", "reset"), ("malformed_sse", "reset"), ("error_mid_stream", "engine_error"),
    ("bad_token_ids", "bad_response"), ("negative_token_ids", "bad_response"),
])
async def test_an_engine_failing_mid_stream_is_replaced_token_exactly(fleet: Fleet, fault: str, reason: str) -> None:
    app = fleet.pair
    ref = await reference(app)
    before = await status(app.url)
    sent = 0
    async with fleet_set(app, tpot_base_s=0.01), engine_set(app, "pair-0", faults=[fault]):
        for i in range(40):  # until pair-0 served two (placement alternates the idle pair; each answer's first
            # token precedes its fault, so pair-0's breaker, 2 in a row, stays closed: docs/contract.md, "Engine failures")
            stream = i % 2 == 0
            r, took = await timed_post(app, greedy(stream))
            sent += 1
            ids, usage = answer_ids(r, stream)
            assert ids == ref, (i, stream, ids, ref)
            assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 0
            assert took < 5, took
            if sum(resumed_since(before, await status(app.url)).values()) >= 2:
                break
    snap = await assert_quiescent(app)
    cuts = resumed_since(before, snap)
    assert set(cuts) == {(reason, "resumed")} and cuts[(reason, "resumed")] >= 2, cuts
    [pair0] = [e for e in snap["engines"] if e["name"] == "pair-0"]  # one failure per answer, none in a row
    assert pair0["breaker_state"] == "closed" and pair0["consecutive_failures"] == 1, pair0
    d = delta(before, snap)
    assert d["offered"] == sent and d["completed"] == sent, d  # one offered, one terminal outcome each


async def test_completions_are_resumed_in_their_own_shape(fleet: Fleet) -> None:
    app = fleet.pair
    ref = await reference(app, "completion")
    before = await status(app.url)
    async with fleet_set(app, tpot_base_s=0.01), engine_set(app, "pair-0", faults=["reset_mid_stream"]):
        for _ in range(8):
            r, _ = await timed_post(app, greedy(True, route="completion"), path=COMPLETIONS)
            events = assert_clean_end(r)
            chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
            assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
            assert answer_ids(r, True)[0] == ref
            if resumed_since(before, await status(app.url)):
                break
    assert resumed_since(before, await assert_quiescent(app)) == {("reset", "resumed"): 1}


async def _timed_stream(app: App, body: dict[str, Any], started: asyncio.Event,
                        headers: dict[str, str] | None = None) -> tuple[list[Any], list[float]]:
    """An SSE stream's events and each one's arrival time (monotonic)."""
    events: list[Any] = []
    times: list[float] = []
    async with httpx.AsyncClient(timeout=30) as c, c.stream("POST", app.url + CHAT, json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                payload = line[6:]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                times.append(time.monotonic())
                started.set()
    return events, times


async def test_an_engine_restarted_mid_answer_is_replaced_and_the_gap_is_short(fleet: Fleet) -> None:
    app = fleet.pair
    body = greedy(True, max_tokens=600)
    r, _ = await timed_post(app, {**body, "stream": False, "stream_options": None})
    ref = r.json()["choices"][0]["token_ids"]
    before = await status(app.url)
    turnaround = await histogram(app, "narwhal_resume_turnaround_seconds")
    # ~6 s of tokens: the restart's graceful shutdown (2 s) cuts the stream before its end
    async with fleet_set(app, tpot_base_s=0.01):
        started = asyncio.Event()
        task = asyncio.ensure_future(_timed_stream(app, {**body, "user": "restart"}, started))
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.sleep(0.3)
        serving = [n for n in app.engines if (await engine_of_running(app, n))]
        assert len(serving) == 1, serving
        await fleet.host.restart(serving[0])
        events, times = await asyncio.wait_for(task, 20)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    ids = [i for e in events if isinstance(e, dict) for c in e.get("choices") or () for i in c.get("token_ids") or ()]
    assert ids == ref
    gaps = [b - a for a, b in zip(times, times[1:])]
    # the client's longest wait between two events: the cut noticed, the router's turn-around and
    # the continuation's prefill (tokens come every 10 ms; the simulator's prefill of a few hundred
    # tokens takes milliseconds), far below the idle timeout that would end a stall
    turned = [b - a for a, b in zip(turnaround, await histogram(app, "narwhal_resume_turnaround_seconds"))]
    print(f"resume gap seen by the client: {max(gaps) * 1000:.1f} ms (tokens every 10 ms); "
          f"the router's turn-around {turned[0] * 1000:.2f} ms")
    assert turned[1] == 1 and turned[0] <= 0.05, turned
    assert max(gaps) < 1.0, max(gaps)
    await wait_usable(app, timeout=10)
    snap = await assert_quiescent(app)
    assert resumed_since(before, snap) == {("reset", "resumed"): 1}
    assert delta(before, snap).get("failed/bad_engine_response") is None


async def histogram(app: App, name: str) -> tuple[float, float]:
    """A histogram's sum and count from the application's /metrics."""
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(app.url + "/metrics")).text
    got = dict(re.findall(rf"^{name}_(sum|count) (\S+)$", text, re.M))
    return float(got["sum"]), float(got["count"])


async def engine_of_running(app: App, name: str) -> bool:
    async with httpx.AsyncClient(timeout=5) as c:
        stats = (await c.get(app.engines[name] + "/sim/stats")).json()
    return bool(stats.get("running"))


async def test_an_engine_stalling_mid_stream_is_replaced_after_the_idle_timeout(fleet: Fleet) -> None:
    app = fleet.pair
    ref = await reference(app)
    before = await status(app.url)
    async with fleet_set(app, tpot_base_s=0.01), engine_set(app, "pair-0", faults=["hang_mid_stream"]):
        for i in range(6):
            r, took = await timed_post(app, greedy(True), {"X-Request-Id": f"stall-{i}"})
            assert answer_ids(r, True)[0] == ref
            if await engine_of(app, f"stall-{i}") == "pair-0" or resumed_since(before, await status(app.url)):
                assert IDLE_TIMEOUT_S - 0.5 <= took < IDLE_TIMEOUT_S + 3, took
                break
    snap = await assert_quiescent(app)
    assert resumed_since(before, snap) == {("stall", "resumed"): 1}


async def test_answers_on_an_engine_whose_breaker_opens_are_resumed_on_the_other_at_once(fleet: Fleet) -> None:
    """Two long greedy answers stream; then one engine fails every new request (HTTP 500) and the
    short requests sent meanwhile open its breaker (2 failures in a row), each of them retried on the
    other engine before headers.  The answers streaming from it are cut as the breaker opens — not
    after the idle timeout, the engine is still producing tokens — and continued exactly on the other."""
    app = fleet.pair
    long = greedy(True, max_tokens=600)
    r, _ = await timed_post(app, {**long, "stream": False, "stream_options": None})
    ref = r.json()["choices"][0]["token_ids"]
    assert len(ref) == 600
    before = await status(app.url)
    async with fleet_set(app, tpot_base_s=0.01):  # ~6 s an answer
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.ensure_future(_timed_stream(app, {**long, "user": f"breaker-{i}"}, started[i],
                                                     {"X-Request-Id": f"breaker-{i}"})) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 10)
        victim = await engine_of(app, "breaker-0")
        assert victim is not None
        on_victim = [i for i in range(2) if await engine_of(app, f"breaker-{i}") == victim]
        async with engine_set(app, victim, faults=["error_500"]):
            for i in range(40):  # placement spreads them; two that land on the victim in a row open it
                r, _ = await timed_post(app, greedy(False, max_tokens=2), {"X-Request-Id": f"short-{i}"})
                assert r.status_code == 200, r.text  # (retried on the other engine before headers)
                [e] = [e for e in (await status(app.url))["engines"] if e["name"] == victim]
                if e["breaker_state"] != "closed":
                    break
            else:
                raise AssertionError("the victim's breaker never opened")
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
    for i, (events, times) in enumerate(results):
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), i
        ids = [t for e in events if isinstance(e, dict) for c in e.get("choices") or () for t in c.get("token_ids") or ()]
        assert ids == ref, i
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) < 1.0, (i, max(gaps))  # the pause at the cut: far below the idle timeout (4 s)
    snap = await assert_quiescent(app)
    assert resumed_since(before, snap) == {("breaker_open", "resumed"): len(on_victim)}
    d = delta(before, snap)
    assert d.get("failed/bad_engine_response") is None
