"""P/D legs failing on the ``pd`` application (one vLLM prefill engine, one decode engine, no other
route): the request ends explicitly — the envelope before response headers, an error event and
``[DONE]`` after — in bounded time, with both engines idle and nothing leaked."""

from __future__ import annotations

import pytest

from tests.fault.conftest import BREAKER_MAX_OPEN_S, FIRST_TOKEN_TIMEOUT_S, IDLE_TIMEOUT_S, Fleet
from tests.fault.helpers import (
    assert_clean_end,
    assert_envelope,
    assert_error_end,
    assert_quiescent,
    delta,
    engine_set,
    received,
    timed_post,
    wait_engine,
    wait_usable,
)
from tests.support.graph import chat_body, status


@pytest.mark.parametrize("stream", [False, True], ids=["assembled", "streaming"])
async def test_pd_prefill_leg_5xx_is_a_502_envelope_and_the_decode_leg_never_starts(fleet: Fleet, stream: bool) -> None:
    app = fleet.pd
    before, engines = await status(app.url), await received(app)
    async with engine_set(app, "pd-prefill", faults=["error_500"]):
        r, took = await timed_post(app, chat_body(stream=stream))
        assert_envelope(r, 502, "bad_engine_response")
        assert took < 5
    after = await received(app)
    assert after["pd-prefill"] > engines["pd-prefill"] and after["pd-decode"] == engines["pd-decode"]
    snap = await assert_quiescent(app)
    assert delta(before, snap)["failed/bad_engine_response"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["assembled", "streaming"])
async def test_pd_prompt_over_the_context_is_refused_in_the_clients_terms(fleet: Fleet, stream: bool) -> None:
    """(Found by a hostile probe.) The prefill leg asks for one token, not the client's 20: an
    engine's refusal of it is not the client's answer; the client's own request then goes to the
    decode engine, whose refusal is.  (This app sizes prompts with the estimate, engines by URL and
    no ``tokenizer:``, so the router cannot refuse it itself: ``tests/unit/gateway/test_context_row.py``
    has the router's own refusal, where it counts exactly.)"""
    app = fleet.pd
    before, engines = await status(app.url), await received(app)
    r, took = await timed_post(app, chat_body(" ".join(["word"] * 4500), stream=stream, max_tokens=20))
    err = assert_envelope(r, 400, "invalid_request", param="input_tokens")
    assert "your prompt contains at least 4097 input tokens" in err["message"], err
    after = await received(app)
    assert after["pd-prefill"] > engines["pd-prefill"] and after["pd-decode"] > engines["pd-decode"]
    snap = await assert_quiescent(app)
    assert delta(before, snap)["invalid_requests"] == 1


async def test_pd_prefill_leg_hang_ends_in_bounded_time(fleet: Fleet) -> None:
    app = fleet.pd
    before = await status(app.url)
    async with engine_set(app, "pd-prefill", faults=["hang"]):
        r, took = await timed_post(app, chat_body(stream=True))
        assert r.status_code in (502, 504), r.text  # no other route: failed at the engine's limits
        assert_envelope(r, r.status_code)
        assert took < IDLE_TIMEOUT_S + 2, took
    snap = await assert_quiescent(app)
    assert delta(before, snap)["offered"] == 1


async def test_pd_decode_leg_5xx_is_a_502_envelope(fleet: Fleet) -> None:
    app = fleet.pd
    before, engines = await status(app.url), await received(app)
    async with engine_set(app, "pd-decode", faults=["error_500"]):
        r, took = await timed_post(app, chat_body(stream=True))
        assert_envelope(r, 502, "bad_engine_response")
        assert took < 5
    after = await received(app)
    assert after["pd-prefill"] > engines["pd-prefill"] and after["pd-decode"] > engines["pd-decode"]
    snap = await assert_quiescent(app)
    assert delta(before, snap)["failed/bad_engine_response"] == 1


@pytest.mark.parametrize("fault", ["reset_mid_stream", "malformed_sse", "hang_mid_stream"])
async def test_pd_decode_leg_failing_mid_stream_ends_with_an_error_event(fleet: Fleet, fault: str) -> None:
    app = fleet.pd
    before = await status(app.url)
    async with engine_set(app, "pd-decode", faults=[fault]):  # the prefill leg is not streamed: unharmed
        r, took = await timed_post(app, chat_body(stream=True, max_tokens=8, sim={"fault_after": 3}))
    assert_error_end(r, "bad_engine_response")
    assert took < (IDLE_TIMEOUT_S + 3 if fault == "hang_mid_stream" else 5), took
    snap = await assert_quiescent(app)
    assert delta(before, snap)["failed/bad_engine_response"] == 1


async def test_pd_decode_engine_down_is_refused_or_failed_then_recovers(fleet: Fleet) -> None:
    app = fleet.pd
    await fleet.host.stop("pd-decode")
    try:
        r, took = await timed_post(app, chat_body())
        assert r.status_code in (502, 503), r.text  # failed at connect, or already out of placement
        assert_envelope(r, r.status_code)
        assert took < FIRST_TOKEN_TIMEOUT_S + 2
        await wait_engine(app, "pd-decode", lambda e: not e["eligible"], "out of placement", timeout=10)
        r, _ = await timed_post(app, chat_body())
        assert_envelope(r, 503, "backend_unavailable")  # no P/D pair left: refused at once, Retry-After
        assert r.headers.get("retry-after") == "1"
    finally:
        await fleet.host.restart("pd-decode")
    await wait_usable(app, timeout=BREAKER_MAX_OPEN_S + 10)
    assert_clean_end((await timed_post(app, chat_body(stream=True)))[0])
    await assert_quiescent(app)
