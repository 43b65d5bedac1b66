"""The SSE response bounds what a slow client can cost: a buffer cap and a write timeout."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.gateway.streaming import Flow, RelayStreamResponse
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.messages import RelayMessage


class Relay:
    """``n`` messages of ``size`` bytes as fast as asked, then a final one; records its closing."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size, self.pulled = n, size, 0
        self.closed = asyncio.Event()

    def __aiter__(self) -> "Relay":
        return self

    async def __anext__(self) -> RelayMessage:
        await asyncio.sleep(0)
        self.pulled += 1
        if self.pulled > self.n:
            return RelayMessage(data=b"data: [DONE]\n\n", final=True)
        return RelayMessage(data=b"x" * self.size)

    async def aclose(self) -> None:
        self.closed.set()


class Client:
    """An ASGI ``send`` whose body writes block after ``reads`` of them (the client stops reading)."""

    def __init__(self, reads: int) -> None:
        self.reads = reads
        self.body: list[bytes] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if len(self.body) >= self.reads:
                await asyncio.Event().wait()
            self.body.append(message["body"])


async def _serve(relay: Relay, client: Client, **kw: Any) -> list[tuple[Outcome, str]]:
    ends: list[tuple[Outcome, str]] = []

    def on_end(o: Outcome, r: str, st: RelayStats | None, code: int) -> None:
        ends.append((o, r))

    gen: AsyncIterator[RelayMessage] = relay
    resp = RelayStreamResponse(RelayMessage(data=b"first"), gen, Flow(lambda m: None, on_end), 60.0, {}, **kw)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async with asyncio.timeout(10):
        await resp({"type": "http"}, receive, client)
        await relay.closed.wait()
    return ends


async def test_a_client_that_reads_everything_gets_everything() -> None:
    relay, client = Relay(50, 1000), Client(10**6)
    assert await _serve(relay, client, buffer_bytes=4096, write_timeout_s=1.0) == [(Outcome.COMPLETED, "")]
    assert client.body[0] == b"first" and client.body[-2] == b"data: [DONE]\n\n" and len(client.body) == 53


async def test_a_client_that_stops_reading_is_not_buffered_past_the_cap_and_is_cut() -> None:
    relay, client = Relay(10**6, 1000), Client(3)
    assert await _serve(relay, client, buffer_bytes=8000, write_timeout_s=0.5) == [(Outcome.FAILED, "slow_reader")]
    assert relay.pulled <= 3 + 9 + 1  # what was written, the cap's worth, and one over


async def test_a_burst_past_the_cap_does_not_cut_a_client_that_reads_everything() -> None:
    relay, client = Relay(200, 1000), Client(10**6)  # the relay has everything at once
    assert await _serve(relay, client, buffer_bytes=4096, write_timeout_s=1.0) == [(Outcome.COMPLETED, "")]
    assert len(client.body) == 203


async def test_a_write_blocked_past_the_timeout_cuts_the_stream() -> None:
    relay, client = Relay(3, 10), Client(2)  # the stream fits the buffer: only the timeout can cut it
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await _serve(relay, client, buffer_bytes=1 << 20, write_timeout_s=0.3) == [(Outcome.FAILED, "slow_reader")]
    assert loop.time() - t0 < 3
