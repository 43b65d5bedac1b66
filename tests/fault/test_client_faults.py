"""Client faults, mostly on the ``tight`` application (one fast engine, one prefill permit, body timeout 1 s,
slow-reader limits 64 KiB / 2 s): clients that leave at every stage, read too slowly, or misbehave
on the wire. Each one ends in exactly one terminal outcome, in bounded time, with nothing leaked."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import pytest

from narwhal_serve.config import ServingConfig
from tests.fault.conftest import BODY_TIMEOUT_S, KEEPALIVE_S, SLOW_READER_TIMEOUT_S, STREAM_BUFFER_BYTES, Fleet
from tests.fault.helpers import (
    CHAT,
    H2,
    Raw,
    Streaming,
    assert_clean_end,
    assert_envelope,
    assert_quiescent,
    content_events,
    delta,
    engine_set,
    engine_stats,
    long_stream,
    timed_post,
)
from tests.support.graph import Held, chat_body, counter, status, wait_engine_idle, wait_status
from tests.support.ray_env import CLIENT_IDLE_S

BODY = json.dumps(chat_body(max_tokens=50, ignore_eos=True)).encode()
# What the kernel buffers between the ingress and a client that never reads (a few MB on loopback)
# takes this long to fill at the simulator's pace on a loaded CI machine; then the cut is immediate.
SLOW_READER_CUT_S = 30.0


def output_tokens(snap: dict[str, Any]) -> int:
    """Output tokens counted for the priority classes (every admitted request has one)."""
    return sum(r["output_tokens"] for r in snap["classes"])


async def test_client_leaving_before_admission_ends_each_offered_request_once(fleet: Fleet) -> None:
    """RST right after the request, at growing delays: somewhere between HAProxy, the body read,
    admission and placement. Whatever the ingress saw is counted once and released."""
    app = fleet.tight
    before = await status(app.url)
    delays = [0, 0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1]
    for wait_s in delays:
        conn = await Raw.open(app)
        await conn.send(Raw.head(app, CHAT, len(BODY)) + BODY)
        await asyncio.sleep(wait_s)
        conn.abort()
    snap = await assert_quiescent(app)
    d = delta(before, snap)
    assert d.get("offered", 0) <= len(delays), d  # (HAProxy may drop one before it is forwarded)
    # one permit, a queue of 2: some may be refused at once (queue_full) before they are noticed gone
    assert set(d) <= {"offered", "cancelled", "completed", "rejected", "cancelled/client_disconnected",
                      "rejected/queue_full", "cancelled/body_incomplete", "unsized_offered"}, d


async def test_client_leaving_mid_body_counts_unsized_and_cancelled(fleet: Fleet) -> None:
    app = fleet.tight
    before = await status(app.url)
    conn = await Raw.open(app)
    await conn.send(Raw.head(app, CHAT, 400) + BODY[:40])
    offered, unsized = before["counters"]["offered"], before["counters"]["unsized_offered"]
    await wait_status(app.url, lambda s: s["counters"]["offered"] > offered, "the body read began")
    conn.abort()
    await wait_status(app.url, lambda s: s["counters"]["unsized_offered"] > unsized, "the early end counted")
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 1, "unsized_offered": 1, "cancelled": 1, "cancelled/body_incomplete": 1}


async def test_client_leaving_while_queued_frees_its_queue_slot(fleet: Fleet) -> None:
    app = fleet.tight
    url = app.url + CHAT
    before = await status(app.url)
    holder = Held(url, chat_body(sim={"fault": "hang"}))  # the one prefill permit
    await wait_status(app.url, lambda s: s["gauges"]["prefill_inflight"] == 1, "the holder admitted")
    queued = Held(url, chat_body("queued"))
    await wait_status(app.url, lambda s: s["gauges"]["queued"] == 1, "the second request queued")
    await queued.cancel()
    await wait_status(app.url, lambda s: s["gauges"]["queued"] == 0 and counter(s, "cancelled", "client_disconnected")
                      == counter(before, "cancelled", "client_disconnected") + 1, "the queued request withdrawn", 5)
    await holder.cancel()
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 2, "cancelled": 2, "cancelled/client_disconnected": 2}


async def test_client_leaving_mid_prefill_aborts_the_engine_request(fleet: Fleet) -> None:
    app = fleet.tight
    engine = app.engines["tight-0"]
    before = await status(app.url)
    async with engine_set(app, "tight-0", prefill_overhead_s=30.0):
        held = Held(app.url + CHAT, chat_body(stream=True))
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while (await engine_stats(engine))["running"] != 1:
            assert loop.time() < end, "the request never reached the engine's prefill"
            await asyncio.sleep(0.05)
        await held.cancel()
        t0 = time.monotonic()
        await wait_engine_idle(engine, timeout=5)  # aborted, not left to run its 30 s prefill
        assert time.monotonic() - t0 < 2 * KEEPALIVE_S + 2
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 1, "cancelled": 1, "cancelled/client_disconnected": 1}


async def test_client_leaving_mid_stream_aborts_the_engine_request(fleet: Fleet) -> None:
    app = fleet.tight
    before = await status(app.url)
    async with engine_set(app, "tight-0", tpot_base_s=0.05):
        s = Streaming(app, long_stream(400))  # ~20 s of tokens
        await s.first_data()
        await s.cancel()
        t0 = time.monotonic()
        await wait_engine_idle(app.engines["tight-0"], timeout=5)
        assert time.monotonic() - t0 < 2 * KEEPALIVE_S + 2
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 1, "cancelled": 1, "cancelled/client_disconnected": 1}
    # its output tokens up to the cut are counted (the class's tokens), not the answer it asked for
    assert 1 <= output_tokens(snap) - output_tokens(before) < 400


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non_streamed"])
async def test_an_http2_stream_reset_ends_that_request_and_spares_the_connection(fleet: Fleet, stream: bool) -> None:
    """Over cleartext HTTP/2 a client cancels one request with ``RST_STREAM`` and keeps the
    connection (a hostile probe reported such a request unseen, running to its end): that request is
    counted ``cancelled{client_disconnected}`` and aborted on the engine, and the next request on the
    same connection runs to its end."""
    app = fleet.tight
    engine = app.engines["tight-0"]
    before = await status(app.url)
    async with engine_set(app, "tight-0", tpot_base_s=0.05):
        conn = await H2.open(app)
        try:
            body = long_stream(400) if stream else chat_body("a long answer", max_tokens=400, ignore_eos=True)
            gone = await conn.post(CHAT, body)  # ~20 s of tokens
            if stream:
                await conn.until(lambda: len(conn.body[gone]) > 0, "the first event", 15)
            else:  # mid-decode: nothing is sent before the whole answer
                loop = asyncio.get_running_loop()
                end = loop.time() + 15
                while (await engine_stats(engine))["running"] != 1:
                    assert loop.time() < end, "the request never reached the engine"
                    await asyncio.sleep(0.05)
                assert conn.status.get(gone) is None
            await conn.reset(gone)
            kept = await conn.post(CHAT, long_stream(5))
            await conn.until(lambda: kept in conn.ended, "the second request's end", 20)
            assert kept not in conn.reset_by_server
            assert_clean_end(httpx.Response(conn.status[kept], content=bytes(conn.body[kept])))
            await wait_engine_idle(engine, timeout=5)  # the cancelled one aborted, not left to run 20 s
            assert gone not in conn.ended
        finally:
            conn.close()
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 2, "completed": 1, "cancelled": 1, "cancelled/client_disconnected": 1}


async def test_slow_reader_is_cut_not_buffered(fleet: Fleet) -> None:
    """A client that never reads, with a small receive window, asks for a long and wide stream
    (logprobs): once the unsent data passes the buffer cap, or a write blocks past the write
    timeout, the stream is cut: failed/slow_reader, the engine request aborted."""
    app = fleet.tight
    before = await status(app.url)
    body = json.dumps(long_stream(30000, logprobs=True, top_logprobs=20)).encode()
    conn = await Raw.open(app, rcvbuf=4096, limit=1024)
    try:
        await conn.send(Raw.head(app, CHAT, len(body)) + body)
        t0 = time.monotonic()
        cut = counter(before, "failed", "slow_reader")
        await wait_status(app.url, lambda s: counter(s, "failed", "slow_reader") > cut, "the slow reader cut",
                          timeout=SLOW_READER_CUT_S)
        took = time.monotonic() - t0
        await wait_engine_idle(app.engines["tight-0"], timeout=10)  # the engine request was aborted
        assert (await engine_stats(app.engines["tight-0"]))["requests"][-1]["body"]["max_tokens"] == 30000
    finally:
        conn.abort()
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 1, "failed": 1, "failed/slow_reader": 1}
    assert took < SLOW_READER_CUT_S + SLOW_READER_TIMEOUT_S, took
    assert 1 <= output_tokens(snap) - output_tokens(before) < 30000  # what the engine made until the cut


async def test_fast_reader_of_a_long_wide_stream_is_not_cut(fleet: Fleet) -> None:
    """The other side of the slow-reader limits: a client that keeps up gets the whole stream, however
    fast and wide (megabytes of logprobs through a 64 KiB cap)."""
    app = fleet.tight
    before = await status(app.url)
    for _ in range(3):
        r, _ = await timed_post(app, long_stream(2000, logprobs=True, top_logprobs=20))
        events = assert_clean_end(r)
        assert len(r.content) > 2 * STREAM_BUFFER_BYTES
        assert content_events(events) == 2000
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 3, "completed": 3}


async def test_slowloris_headers_get_a_408_and_a_closed_connection(fleet: Fleet) -> None:
    app = fleet.tight
    before = await status(app.url)
    conn = await Raw.open(app)
    await conn.send(f"POST {app.prefix}{CHAT} HTTP/1.1\r\nHost: x\r\n".encode())

    async def trickle() -> None:
        for i in range(100):
            await conn.send(f"X-Slow-{i}: y\r\n".encode())
            await asyncio.sleep(0.2)

    t0 = time.monotonic()
    dripping = asyncio.get_running_loop().create_task(trickle())
    try:
        answer = await conn.rest(timeout=10)  # until HAProxy closes the connection
    finally:
        dripping.cancel()
        await asyncio.gather(dripping, return_exceptions=True)
        conn.close()
    took = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 1.5 <= took < 6, took  # NARWHAL_HTTP_HEADER_TIMEOUT_S=2 in tests: total time for the headers
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {}  # it never became a request


@pytest.mark.parametrize("trickled", [True, False], ids=["trickled_body", "content_length_longer_than_the_body"])
async def test_body_that_never_completes_gets_a_408_envelope(fleet: Fleet, trickled: bool) -> None:
    """A body trickled a byte at a time, or one shorter than its Content-Length from a client that
    keeps the connection open: 408 in the envelope once serving.body_timeout_s has passed, with
    ``Connection: close``; a client that then sends nothing more is disconnected by HAProxy once its
    client timeout passes (the announced body never completes)."""
    app = fleet.tight
    before = await status(app.url)
    conn = await Raw.open(app)
    await conn.send(Raw.head(app, CHAT, 400) + b'{"model": "narwhal-sim", ')

    async def trickle() -> None:
        for _ in range(100 if trickled else 0):
            await conn.send(b" ")  # never idle, never done
            await asyncio.sleep(0.2)

    t0 = time.monotonic()
    dripping = asyncio.get_running_loop().create_task(trickle())
    try:
        code, headers, payload = await conn.response(timeout=BODY_TIMEOUT_S + 5)
        answered_after = time.monotonic() - t0
        dripping.cancel()
        await asyncio.gather(dripping, return_exceptions=True)
        quiet = time.monotonic()
        after = await conn.rest(timeout=CLIENT_IDLE_S + 5)  # until HAProxy closes the connection
        closed_after = time.monotonic() - quiet
    finally:
        dripping.cancel()
        await asyncio.gather(dripping, return_exceptions=True)
        conn.close()
    assert after == b"" and closed_after < CLIENT_IDLE_S + 3, (after[:200], closed_after)
    assert code == 408, payload[:200]
    # the client is told the connection ends (the rest of that body cannot be told from a next request)
    assert headers.get("connection", "").lower() == "close", headers
    err = json.loads(payload)["error"]
    assert (err["code"], err["type"]) == ("request_timeout", "invalid_request_error") and "param" in err
    assert answered_after < BODY_TIMEOUT_S + 3
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 1, "unsized_offered": 1, "invalid_requests": 1,
                                   "invalid_requests/request_timeout": 1}


async def test_expect_over_the_body_limit_is_refused_before_the_body_is_invited(fleet: Fleet) -> None:
    """``Expect: 100-continue`` with a Content-Length over ``serving.max_request_bytes``: the 413
    envelope is the first answer (no ``100 Continue`` first), from the ingress (HAProxy): the router
    never sees the request, so nothing is counted."""
    app = fleet.pair
    before = await status(app.url)
    conn = await Raw.open(app)
    try:
        await conn.send(Raw.head(app, CHAT, ServingConfig().max_request_bytes + 1, "Expect: 100-continue\r\n"))
        code, headers, payload = await conn.response(timeout=5)
    finally:
        conn.close()
    assert code == 413, payload[:200]
    err = json.loads(payload)["error"]
    assert (err["code"], err["type"]) == ("request_too_large", "invalid_request_error"), err
    assert headers.get("connection", "").lower() == "close", headers
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {}


async def test_expect_with_a_slow_upload_is_answered_whole(fleet: Fleet) -> None:
    """``Expect: 100-continue``, then the body in three parts 0.6 s apart: the answer is the
    router's 200 (HAProxy once waited only 1 s for the whole body after its 100 Continue)."""
    app = fleet.pair
    before = await status(app.url)
    payload = json.dumps(chat_body(max_tokens=2)).encode()
    conn = await Raw.open(app)
    try:
        await conn.send(Raw.head(app, CHAT, len(payload), "Expect: 100-continue\r\n"))
        assert await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        third = len(payload) // 3
        for part in (payload[:third], payload[third:2 * third], payload[2 * third:]):
            await conn.send(part)
            await asyncio.sleep(0.6)
        code, _, answer = await conn.response(timeout=10)
    finally:
        conn.close()
    assert code == 200, answer[:300]
    assert json.loads(answer)["usage"]["completion_tokens"] == 2
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 1, "completed": 1}


async def test_content_length_longer_than_the_body_then_half_close_ends_the_request(fleet: Fleet) -> None:
    """The client says 400 bytes, sends 40 and closes its sending side (still reading): the request
    ends at once as an incomplete body (unsized, cancelled); whatever comes back is the envelope
    (HAProxy closes the connection: a client that stopped sending has aborted)."""
    app = fleet.tight
    before = await status(app.url)
    conn = await Raw.open(app)
    await conn.send(Raw.head(app, CHAT, 400) + BODY[:40])
    t0 = time.monotonic()
    conn.writer.get_extra_info("socket").shutdown(socket.SHUT_WR)
    try:
        answer = await conn.rest(timeout=BODY_TIMEOUT_S + 5)
    finally:
        conn.close()
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 2
    if answer:
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 4"), answer[:200]
        err = json.loads(payload)["error"]
        assert {"message", "type", "param", "code"} <= set(err), err
    snap = await assert_quiescent(app)
    # HAProxy may see the half-close before it hands the request on: then it aborts the request
    # itself and the router never sees it (not offered, like the requests HAProxy answers, docs/contract.md,
    # "Errors"); otherwise the router ends it as an incomplete body. Never anything else.
    assert delta(before, snap) in ({}, {"offered": 1, "unsized_offered": 1, "cancelled": 1,
                                        "cancelled/body_incomplete": 1})


async def test_content_length_shorter_than_the_body_gets_a_400_envelope(fleet: Fleet) -> None:
    """The client says fewer bytes than it sends: the router reads what was announced (truncated
    JSON → 400 in the envelope); the rest is not a request and the connection ends, in bounded time."""
    app = fleet.tight
    before = await status(app.url)
    body = json.dumps({**chat_body(), "user": "x" * 40}).encode()
    conn = await Raw.open(app)
    await conn.send(Raw.head(app, CHAT, len(body) - 20) + body)
    try:
        code, _, payload = await conn.response(timeout=10)
        rest = await conn.rest(timeout=10)  # the leftover bytes: refused by the HTTP layer, then closed
    finally:
        conn.close()
    assert code == 400, payload[:200]
    err = json.loads(payload)["error"]
    assert err["code"] == "invalid_request" and "param" in err, err
    assert not rest or rest.startswith(b"HTTP/1.1 4"), rest[:200]
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 1, "invalid_requests": 1, "invalid_requests/invalid_request": 1}


async def test_serve_request_timeout_header_is_not_an_outside_control(fleet: Fleet) -> None:
    """Ray Serve's own ``x-request-timeout-seconds`` neither cuts a stream nor answers early."""
    app = fleet.tight
    before = await status(app.url)
    serve_timeout = {"x-request-timeout-seconds": "0.2"}
    async with engine_set(app, "tight-0", tpot_base_s=0.05):
        r, took = await timed_post(app, chat_body(stream=True, max_tokens=20, ignore_eos=True), serve_timeout)
    assert_clean_end(r)
    assert took >= 0.9, took  # ~1 s of tokens, not cut at 0.2 s
    r, took = await timed_post(app, chat_body(sim={"fault": "hang"}), {**serve_timeout, "X-Request-Timeout": "1.2"})
    assert_envelope(r, 504, "deadline_expired")  # Narwhal's deadline, not Serve's plain-text 408
    assert 1.0 <= took < 1.2 + 2, took
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 2, "completed": 1, "expired": 1, "expired/deadline_expired": 1}


async def test_logprobs_beyond_the_engines_limit_are_refused_in_the_routers_words(fleet: Fleet) -> None:
    """``top_logprobs`` (chat) or ``logprobs`` (completions) above ``serving.max_logprobs`` (the
    engines' --max-logprobs): a 400 naming the field and the bound, not the engine's validation dump."""
    app = fleet.tight
    before = await status(app.url)
    r, _ = await timed_post(app, chat_body(logprobs=True, top_logprobs=1000))
    assert_envelope(r, 400, "invalid_request")
    err = r.json()["error"]
    assert err["param"] == "top_logprobs" and "0 to 20" in err["message"], err
    r, _ = await timed_post(app, {"model": "narwhal-sim", "prompt": "x", "logprobs": 21}, path="/v1/completions")
    assert_envelope(r, 400, "invalid_request")
    assert r.json()["error"]["param"] == "logprobs"
    r, _ = await timed_post(app, chat_body(logprobs=True, top_logprobs=20, max_tokens=2))
    assert r.status_code == 200, r.text
    snap = await assert_quiescent(app)
    assert delta(before, snap) == {"offered": 3, "completed": 1, "invalid_requests": 2,
                                   "invalid_requests/invalid_request": 2}
