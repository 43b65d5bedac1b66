"""A stream cut before its end (the client left, read too slowly, the router stopped) still
reports what the router saw: the route that was answering and the output tokens identified so far
(RelayStats.cut) — counted in the request log and the tenants' and classes' output tokens, never
learned from (it has no timings)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from narwhal_serve.admission.view import Placement
from narwhal_serve.config import EngineConfig
from narwhal_serve.gateway.streaming import Flow, RelayStreamResponse
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.telemetry import Histogram
from narwhal_serve.tenants.tally import TenantTally

Ends = list[tuple[Outcome, str, RelayStats | None]]


def _flow(ends: Ends) -> Flow:
    return Flow(lambda m: None, lambda o, r, st, code: ends.append((o, r, st)))


class Tokens:
    """A relay that streams one token per message after its first, ``n`` of them, then ends."""

    def __init__(self, n: int, engines: tuple[str, ...] = ("u-0",)) -> None:
        self.n, self.engines, self.sent = n, engines, 0
        self.closed = asyncio.Event()

    def __aiter__(self) -> "Tokens":
        return self

    async def __anext__(self) -> RelayMessage:
        await asyncio.sleep(0)
        self.sent += 1
        if self.sent > self.n:
            stats = RelayStats("single", self.engines, 0.1, self.n + 1, 0.2, 1)
            return RelayMessage(data=b"data: [DONE]\n\n", final=True, stats=stats)
        return RelayMessage(data=b"data: {}\n\n", tokens=self.sent + 1)

    async def aclose(self) -> None:
        self.closed.set()


class Leaves:
    """An ASGI ``send`` of a client that goes away after ``reads`` body writes (the write fails)."""

    def __init__(self, reads: int) -> None:
        self.reads, self.body = reads, 0

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if self.body >= self.reads:
                raise OSError("the client went away")
            self.body += 1


async def _serve(relay: Tokens, send: Any, ends: Ends) -> None:
    first = RelayMessage(data=b"data: {}\n\n", first_token=True, engines=relay.engines, tokens=1)
    flow = _flow(ends)
    flow.observe(first)  # (the gateway observes the first message before the response starts)
    gen: AsyncIterator[RelayMessage] = relay
    resp = RelayStreamResponse(first, gen, flow, 60.0, {}, buffer_bytes=1 << 20, write_timeout_s=5.0)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async with asyncio.timeout(10):
        await resp({"type": "http"}, receive, send)
        await relay.closed.wait()


async def test_a_client_that_leaves_mid_stream_is_counted_with_its_engines_and_tokens_so_far() -> None:
    relay, ends = Tokens(10_000), []
    await _serve(relay, Leaves(5), ends)
    [(outcome, reason, stats)] = ends
    assert (outcome, reason) == (Outcome.CANCELLED, "client_disconnected")
    assert stats is not None and stats.partial and stats.engines == ("u-0",)
    # the tokens the relay identified before the cut: at least what the client got, never the whole answer
    assert 5 <= stats.output_tokens <= relay.sent + 1 < 10_000
    assert stats.ttft_s is None and stats.attempts == 0  # no timings to learn from


async def test_a_stream_that_ends_keeps_the_relays_own_stats() -> None:
    relay, ends = Tokens(20), []
    await _serve(relay, Leaves(10**6), ends)
    [(outcome, _, stats)] = ends
    assert outcome is Outcome.COMPLETED and stats is not None and not stats.partial and stats.output_tokens == 21


async def test_a_client_that_leaves_during_the_last_writes_is_counted_with_the_relays_own_stats() -> None:
    relay, ends = Tokens(20), []
    await _serve(relay, Leaves(21), ends)  # the first message and 20 tokens written; [DONE]'s write fails
    [(outcome, _, stats)] = ends
    assert outcome is Outcome.CANCELLED and stats is not None and not stats.partial
    assert stats.output_tokens == 21 and stats.ttft_s == 0.1  # the relay's own, exact


def test_an_end_before_the_first_token_has_no_stats() -> None:
    ends: Ends = []
    flow = _flow(ends)
    flow.observe(RelayMessage(tokens=0))
    flow.end(Outcome.CANCELLED, "client_disconnected", status=499)
    assert ends == [(Outcome.CANCELLED, "client_disconnected", None)]


def test_a_resumed_stream_cut_later_names_the_route_it_moved_to() -> None:
    ends: Ends = []
    flow = _flow(ends)
    flow.observe(RelayMessage(data=b"x", first_token=True, engines=("a",), tokens=1))
    flow.observe(RelayMessage(data=b"x", engines=("b",), moved=True, tokens=7))
    flow.end(Outcome.FAILED, "slow_reader")
    [(_, _, stats)] = ends
    assert stats == RelayStats.cut(("b",), 7)


def test_partial_stats_are_counted_but_not_learned_from() -> None:
    cfg = EngineConfig(name="e", url="http://127.0.0.1:9", role="unified")
    e = EngineState(cfg)
    hists = {k: Histogram() for k in ("ttft", "tpot", "ttft_prediction_error", "ttft_predicted")}
    p = Placement((RouteChoice(kind="single", decode=cfg),), "e", 100, 100, 0.0, 0.05)
    learn_from(RelayStats.cut(("e",), 40), p, {"e": e}, hists)
    assert not e.ttft_model.samples and not e.tpot_model.samples and e.tpot_s is None
    assert all(h.n == 0 for h in hists.values())
    learn_from(RelayStats("single", ("e",), 0.04, 40, 0.39, 1), p, {"e": e}, hists)  # the same, whole
    assert e.tpot_s == pytest.approx(0.01) and hists["ttft"].n == 1

    tally = TenantTally(("acme",), ("standard",))
    tally.ended("acme", p, RelayStats.cut(("e",), 40), completed=False)
    assert tally.served[("acme", "output_tokens")] == 40 and tally.served[("acme", "goodput")] == 0
