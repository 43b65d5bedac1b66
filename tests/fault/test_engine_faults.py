"""Engine faults on the ``pair`` application (two unified engines): before response headers a failed
attempt moves to the other engine (after them it is resumed there: ``test_resume_faults.py``).  On
``solo`` (one engine, nowhere to resume) a failure after headers ends the stream with one error event
and ``[DONE]``.  Every scenario ends quiescent: no leaked permit, balanced counters, idle engines."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from tests.fault.conftest import (
    BACKPRESSURE_S,
    BREAKER_MAX_OPEN_S,
    FIRST_TOKEN_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    STALE_AFTER_S,
    App,
    Fleet,
)
from tests.fault.helpers import (
    Streaming,
    assert_clean_end,
    assert_envelope,
    assert_error_end,
    assert_quiescent,
    content_events,
    delta,
    engine_of,
    engine_set,
    engine_stats,
    engine_view,
    fleet_set,
    long_stream,
    sse_events,
    timed_post,
    wait_engine,
    wait_usable,
)
from tests.support.graph import chat_body, status

_ids = itertools.count()


def rid(tag: str) -> str:
    return f"fault-{tag}-{next(_ids)}"


async def seen_by(app: App, name: str, request_ids: list[str]) -> list[str]:
    """Which of ``request_ids`` reached engine ``name``."""
    got = {r["request_id"] for r in (await engine_stats(app.engines[name]))["requests"]}
    return [r for r in request_ids if r in got]


async def until_tried(app: App, faulty: str, body: Any, *, least: int = 4, tries: int = 1, most: int = 12,
                      bound_s: float = 10.0, tag: str = "x") -> list[str]:
    """Requests one after another (``body(i)``), each answered in full and in time, until at least
    ``least`` went out and ``faulty`` got ``tries`` of them (so failovers really happened). Their ids."""
    ids: list[str] = []
    for i in range(most):
        b = body(i)
        ids.append(rid(tag))
        r, took = await timed_post(app, b, {"X-Request-Id": ids[-1]})
        if b.get("stream"):
            assert_clean_end(r)
        else:
            assert r.status_code == 200, r.text
        assert took < bound_s, f"request {i} took {took:.1f} s"
        if i + 1 >= least and len(await seen_by(app, faulty, ids)) >= tries:
            return ids
    raise AssertionError(f"{faulty} got fewer than {tries} attempts in {most} requests: nothing was failed over")


def mixed(i: int, **kw: Any) -> dict[str, Any]:
    """Streaming and non-streaming in turn."""
    return chat_body(stream=bool(i % 2), **kw)


# -- before response headers: the next engine -----------------------------------------------------

@pytest.mark.parametrize("fault", ["error_500", "reset_mid_stream", "malformed_sse", "bad_token_ids",
                                   "negative_token_ids", "missing_token_ids"])
async def test_engine_fault_before_the_first_token_fails_over(fleet: Fleet, fault: str) -> None:
    app = fleet.pair
    before = await status(app.url)
    async with engine_set(app, "pair-0", faults=[fault]):
        ids = await until_tried(app, "pair-0", lambda i: mixed(i, return_token_ids=True, sim={"fault_after": 0}),
                                tag=fault)
    snap = await assert_quiescent(app)
    assert delta(before, snap).get("completed") == len(ids)


async def test_engine_5xx_opens_its_breaker_no_placements_while_open_probe_closes_it(fleet: Fleet) -> None:
    app = fleet.pair
    # from a clean slate: a failure counted by an earlier test would open the breaker at the first 5xx
    await until_tried(app, "pair-0", mixed, least=1, tag="clean")
    await wait_engine(app, "pair-0", lambda e: e["consecutive_failures"] == 0, "a good answer reset its failures")
    async with engine_set(app, "pair-0", faults=["error_500"]):
        await until_tried(app, "pair-0", mixed, least=2, tries=2, tag="5xx")
        view = await wait_engine(app, "pair-0", lambda e: e["breaker"] == "open", "breaker open", timeout=10)
        assert view["consecutive_failures"] >= 2 and view["open_for_s"] is not None and not view["eligible"]
        later = [rid("open") for _ in range(4)]
        for r_id in later:  # while open (and probing: the probe fails too), no client work goes there
            r, _ = await timed_post(app, chat_body(), {"X-Request-Id": r_id})
            assert r.status_code == 200
        assert await seen_by(app, "pair-0", later) == []
        assert (await engine_view(app, "pair-0"))["breaker"] == "open"
    # engine_set left the block once a probe had closed the breaker (bounded by breaker_max_open_s)
    view = await engine_view(app, "pair-0")
    assert view["breaker"] == "closed" and view["consecutive_failures"] == 0 and view["open_for_s"] is None
    await until_tried(app, "pair-0", mixed, least=1, tag="healed")  # it takes work again
    await assert_quiescent(app)


async def test_engine_hang_before_the_first_token_fails_over_at_the_first_token_timeout(fleet: Fleet) -> None:
    app = fleet.pair
    failures = (await engine_view(app, "pair-0"))["consecutive_failures"]
    async with engine_set(app, "pair-0", faults=["hang"]):
        await until_tried(app, "pair-0", mixed, least=2, bound_s=FIRST_TOKEN_TIMEOUT_S + 2.0, tag="hang")
        await wait_engine(app, "pair-0", lambda e: e["consecutive_failures"] > failures or e["breaker"] == "open",
                          "the timeout counted as a failure", timeout=5)
    await assert_quiescent(app)


async def test_engine_slow_prefill_past_the_first_token_timeout_fails_over_and_is_aborted(fleet: Fleet) -> None:
    app = fleet.pair
    failures = (await engine_view(app, "pair-0"))["consecutive_failures"]
    async with engine_set(app, "pair-0", prefill_overhead_s=20.0):
        await until_tried(app, "pair-0", mixed, least=2, bound_s=FIRST_TOKEN_TIMEOUT_S + 2.0, tag="slowprefill")
        await wait_engine(app, "pair-0", lambda e: e["consecutive_failures"] > failures or e["breaker"] == "open",
                          "the timeout counted as a failure", timeout=5)
    await assert_quiescent(app)  # pair-0 idle: the abandoned prefill was aborted, not left running


@pytest.mark.parametrize("fault", ["error_429", "error_503"])
async def test_engine_busy_answer_is_backpressure_not_a_failure(fleet: Fleet, fault: str) -> None:
    app = fleet.pair
    failures = (await engine_view(app, "pair-0"))["consecutive_failures"]
    async with engine_set(app, "pair-0", faults=[fault], retry_after_s=4):
        await until_tried(app, "pair-0", mixed, least=1, tag=fault)
        view = await engine_view(app, "pair-0")
        assert view["breaker"] == "closed" and view["consecutive_failures"] == failures, view  # not a failure
        assert view["backpressure_for_s"] is not None, view
        assert BACKPRESSURE_S < view["backpressure_for_s"] <= 4.0, view  # the engine's Retry-After, not the default
        later = [rid("busy") for _ in range(3)]
        for r_id in later:  # inside the window: no new placements there
            r, _ = await timed_post(app, chat_body(), {"X-Request-Id": r_id})
            assert r.status_code == 200
        assert await seen_by(app, "pair-0", later) == []
    await wait_engine(app, "pair-0", lambda e: e["backpressure_for_s"] is None and e["eligible"], "window over", 6)
    await assert_quiescent(app)


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_busy_on_every_route_is_a_retryable_refusal_not_a_failure(fleet: Fleet, stream: bool) -> None:
    """Every route answered 429/503: the client gets 503 backend_unavailable with the engines' own
    Retry-After (before headers, streaming or not), counted rejected (engine_backpressure)."""
    app = fleet.pair
    before = await status(app.url)
    r, took = await timed_post(app, chat_body(stream=stream, sim={"fault": "error_429"}))
    err = assert_envelope(r, 503, "backend_unavailable")
    assert err["type"] == "service_unavailable_error"
    assert r.headers["retry-after"] == "1" and r.headers["x-narwhal-reason"] == "engine_backpressure"  # the sims' own
    assert took < FIRST_TOKEN_TIMEOUT_S + 2
    snap = await assert_quiescent(app)  # (usable again once the backpressure windows end)
    d = delta(before, snap)
    assert d["offered"] == 1 and d.get("rejected/engine_backpressure") == 1 and not d.get("failed"), d


async def test_engine_5xx_on_every_route_is_a_502_envelope(fleet: Fleet) -> None:
    app = fleet.pair
    before = await status(app.url)
    for stream in (False, True):
        r, _ = await timed_post(app, chat_body(stream=stream, sim={"fault": "error_500"}))
        err = assert_envelope(r, 502, "bad_engine_response")
        assert err["type"] == "upstream_error"
    snap = await assert_quiescent(app)
    assert delta(before, snap)["failed/bad_engine_response"] == 2


# -- after response headers, no other engine: an explicit end ---------------------------------------

def no_engine_cuts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    old = {(r["reason"], r["outcome"]): r["count"] for r in before["resumes"]}
    return {f"{r['reason']}/{r['outcome']}": r["count"] - old.get((r["reason"], r["outcome"]), 0)
            for r in after["resumes"] if r["count"] != old.get((r["reason"], r["outcome"]), 0)}


@pytest.mark.parametrize(("fault", "after", "reason"), [
    ("reset_mid_stream", 3, "reset"), ("malformed_sse", 3, "reset"), ("bad_token_ids", 2, "bad_response"),
    ("negative_token_ids", 2, "bad_response"),
])
async def test_engine_fault_mid_stream_with_no_other_engine_ends_with_an_error_event(
        fleet: Fleet, fault: str, after: int, reason: str) -> None:
    app = fleet.solo
    before = await status(app.url)
    body = chat_body(stream=True, return_token_ids=True, max_tokens=6, sim={"fault": fault, "fault_after": after})
    # tokens 50 ms apart: the first goes out (response headers) before the faulty one is read
    # (read in one batch, a bad token ID would fail the attempt before headers: a 502, correctly)
    async with fleet_set(app, tpot_base_s=0.05):
        r, took = await timed_post(app, body)
    assert_error_end(r, "bad_engine_response")
    assert any(isinstance(e, dict) and e.get("choices") for e in sse_events(r.text)[:-2])  # tokens came first
    assert took < 5
    snap = await assert_quiescent(app)
    assert delta(before, snap)["failed/bad_engine_response"] == 1
    assert no_engine_cuts(before, snap) == {f"{reason}/no_engine": 1}


async def test_engine_stall_after_the_first_token_with_no_other_engine_ends_at_the_idle_timeout(fleet: Fleet) -> None:
    app = fleet.solo
    before = await status(app.url)
    r, took = await timed_post(app, chat_body(stream=True, sim={"fault": "hang_mid_stream", "fault_after": 3}))
    assert_error_end(r, "bad_engine_response")
    assert IDLE_TIMEOUT_S - 0.5 <= took < IDLE_TIMEOUT_S + 3, took
    snap = await assert_quiescent(app)  # the stalled engine request was aborted
    assert delta(before, snap)["failed/bad_engine_response"] == 1


async def test_engine_stall_after_the_first_token_ends_within_the_deadline(fleet: Fleet) -> None:
    app = fleet.pair
    before = await status(app.url)
    r, took = await timed_post(app, chat_body(stream=True, sim={"fault": "hang_mid_stream", "fault_after": 2}),
                               {"X-Request-Timeout": "1.5"})
    err = assert_error_end(r, "deadline_expired")
    assert err["type"] == "timeout_error"
    assert took < 1.5 + 2, took
    snap = await assert_quiescent(app)
    assert delta(before, snap)["expired/deadline_expired"] == 1


async def test_engine_slow_tokens_are_not_cut(fleet: Fleet) -> None:
    app = fleet.pair
    async with fleet_set(app, tpot_base_s=0.3):
        r, took = await timed_post(app, chat_body(stream=True, max_tokens=5, ignore_eos=True))
    events = assert_clean_end(r)
    assert content_events(events) == 5
    assert took >= 4 * 0.3 - 0.1
    await assert_quiescent(app)


async def test_engine_omitting_usage_still_gives_the_client_a_usage_chunk(fleet: Fleet) -> None:
    app = fleet.pair
    body = chat_body(stream=True, max_tokens=5, ignore_eos=True, stream_options={"include_usage": True},
                     sim={"fault": "missing_usage"})
    r, _ = await timed_post(app, body)
    events = assert_clean_end(r)
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 5 and usage[0]["prompt_tokens"] > 0, usage
    assert usage[0]["total_tokens"] == usage[0]["prompt_tokens"] + 5
    last = events[-2]
    assert last.get("usage") and last["choices"] == [], last  # the usage chunk comes last, before [DONE]
    r, _ = await timed_post(app, {**body, "stream": False, "stream_options": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    await assert_quiescent(app)


# -- engines that go away -----------------------------------------------------------------------------

async def test_engine_stale_metrics_takes_it_out_of_placement(fleet: Fleet) -> None:
    app = fleet.pair
    async with engine_set(app, "pair-0", faults=["stale_metrics"]):
        # out of the scheduler's placement, and past what an ingress lease's view (a renewal old,
        # moved into the ingress's clock) may still allow
        await wait_engine(app, "pair-0", lambda e: not e["eligible"] and (e["metrics_age_s"] or 0) > STALE_AFTER_S + 1,
                          "ineligible (stale metrics)", timeout=10)
        ids = [rid("stale") for _ in range(4)]
        for r_id in ids:
            r, _ = await timed_post(app, chat_body(), {"X-Request-Id": r_id})
            assert r.status_code == 200
        assert await seen_by(app, "pair-0", ids) == []
    await assert_quiescent(app)


async def test_engine_refusing_connections_fails_over_and_a_restart_brings_it_back(fleet: Fleet) -> None:
    app = fleet.pair
    await fleet.host.stop("pair-0")
    try:
        rs = await asyncio.gather(*(timed_post(app, mixed(i)) for i in range(4)))  # before a scrape notices
        for r, took in rs:
            assert r.status_code == 200, r.text
            assert took < FIRST_TOKEN_TIMEOUT_S + 2
        await wait_engine(app, "pair-0", lambda e: not e["eligible"], "out of placement", timeout=10)
        for i in range(2):
            r, _ = await timed_post(app, mixed(i))
            assert r.status_code == 200
    finally:
        await fleet.host.restart("pair-0")
    await wait_usable(app, timeout=BREAKER_MAX_OPEN_S + 10)
    await until_tried(app, "pair-0", mixed, least=1, tag="restarted")
    await assert_quiescent(app)


async def test_engine_process_killed_mid_stream_ends_the_stream_then_restarts(fleet: Fleet) -> None:
    app, proc = fleet.solo, fleet.proc
    before = await status(app.url)
    s = Streaming(app, long_stream(3000))  # ~6 s of tokens
    await s.first_data()
    t0 = time.monotonic()
    try:
        proc.kill()
        r = await s.end(timeout=IDLE_TIMEOUT_S + 5)
        assert_error_end(r, "bad_engine_response")
        assert s.ended_at is not None
        assert s.ended_at - t0 < 3, s.ended_at - t0
        r, took = await timed_post(app, chat_body())  # nowhere to go: refused or failed, in the envelope, in time
        assert r.status_code in (502, 503), r.text
        assert_envelope(r, r.status_code)
        assert took < FIRST_TOKEN_TIMEOUT_S + 2
    finally:
        if proc.proc is not None and not proc.proc.alive():
            await asyncio.to_thread(proc.start)
    await wait_usable(app, timeout=BREAKER_MAX_OPEN_S + 10)
    r, _ = await timed_post(app, chat_body())
    assert r.status_code == 200, r.text
    snap = await assert_quiescent(app)
    assert delta(before, snap)["failed/bad_engine_response"] >= 1


async def test_engine_process_frozen_ends_streams_at_the_idle_timeout_and_recovers(fleet: Fleet) -> None:
    app, proc = fleet.solo, fleet.proc
    s = Streaming(app, long_stream(3000))
    await s.first_data()
    t0 = time.monotonic()
    proc.freeze()
    try:
        # a hung engine and no other route: failed (idle timeout) or refused (out of placement) in time
        r, took = await timed_post(app, chat_body())
        assert r.status_code in (502, 503, 504), r.text
        assert_envelope(r, r.status_code)
        assert took < IDLE_TIMEOUT_S + 2, took
        r = await s.end(timeout=IDLE_TIMEOUT_S + 5)
        assert_error_end(r, "bad_engine_response")
        assert s.ended_at is not None and s.ended_at - t0 < IDLE_TIMEOUT_S + 3
    finally:
        proc.thaw()
    await wait_usable(app, timeout=BREAKER_MAX_OPEN_S + 10)
    r, _ = await timed_post(app, chat_body())
    assert r.status_code == 200, r.text
    await assert_quiescent(app)
