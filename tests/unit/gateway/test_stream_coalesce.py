"""The SSE writer sends what piled up while it was busy as one write, and never waits for more."""

from __future__ import annotations

import asyncio
from typing import Any

from narwhal_serve.gateway import streaming
from narwhal_serve.gateway.streaming import Flow, RelayStreamResponse
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.messages import RelayMessage

DONE = b"data: [DONE]\n\n"


class Relay:
    """Messages handed over one at a time, each when the test releases it (or all at once)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.queue: asyncio.Queue[RelayMessage] = asyncio.Queue()
        self.closed = asyncio.Event()

    def release(self, k: int) -> None:
        for _ in range(k):
            data = self.chunks.pop(0)
            self.queue.put_nowait(RelayMessage(data=data, final=data == DONE))

    def __aiter__(self) -> "Relay":
        return self

    async def __anext__(self) -> RelayMessage:
        return await self.queue.get()

    async def aclose(self) -> None:
        self.closed.set()


class Client:
    """Records each body write; a write can be held until the test lets it finish."""

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.wrote = asyncio.Event()

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.body.append(message["body"])
            self.wrote.set()
            await self.hold.wait()


async def _start(relay: Relay, client: Client) -> tuple["asyncio.Task[None]", list[Outcome]]:
    ends: list[Outcome] = []

    def on_end(o: Outcome, r: str, st: RelayStats | None, code: int) -> None:
        ends.append(o)

    resp = RelayStreamResponse(RelayMessage(data=b"first"), relay, Flow(lambda m: None, on_end), 60.0, {})

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    return asyncio.ensure_future(resp({"type": "http"}, receive, client)), ends


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_messages_that_piled_up_behind_a_slow_write_go_out_as_one_write_in_order() -> None:
    relay, client = Relay([b"a", b"b", b"c", b"d", DONE]), Client()
    client.hold.clear()  # the first write ("first") does not finish yet
    task, ends = await _start(relay, client)
    async with asyncio.timeout(5):
        await client.wrote.wait()
        relay.release(3)  # three messages arrive while the writer is busy
        await _settle()
        client.hold.set()
        await _settle()
        relay.release(2)
        await task
        await relay.closed.wait()
    # without the joining, each message was a write of its own: first, a, b, c, d, [DONE], end
    assert client.body[:2] == [b"first", b"abc"], client.body
    assert b"".join(client.body) == b"firstabcd" + DONE and client.body[-1] == b""
    assert ends == [Outcome.COMPLETED]


async def test_a_client_that_keeps_up_gets_each_message_as_it_comes() -> None:
    relay, client = Relay([b"a", b"b", DONE]), Client()
    task, ends = await _start(relay, client)
    async with asyncio.timeout(5):
        for k, want in enumerate((b"a", b"b"), start=2):
            relay.release(1)
            while len(client.body) < k:  # the writer sent it before anything more came
                await asyncio.sleep(0)
            assert client.body[-1] == want
        relay.release(1)
        await task
    assert client.body == [b"first", b"a", b"b", DONE, b""] and ends == [Outcome.COMPLETED]


async def test_a_join_stops_at_its_size_cap_and_the_rest_follows(monkeypatch: Any) -> None:
    monkeypatch.setattr(streaming, "COALESCE_BYTES", 4)
    relay, client = Relay([b"aa", b"bb", b"cc", b"dd", DONE]), Client()
    client.hold.clear()
    task, ends = await _start(relay, client)
    async with asyncio.timeout(5):
        await client.wrote.wait()
        relay.release(5)
        await _settle()
        client.hold.set()
        await task
    assert client.body == [b"first", b"aabb", b"ccdd", DONE, b""], client.body
    assert ends == [Outcome.COMPLETED]


async def test_a_final_error_that_piled_up_ends_the_stream_with_its_outcome() -> None:
    from narwhal_serve.errors import NarwhalError
    from narwhal_serve.protocol.sse import error_events

    err = NarwhalError("engine failed", code="engine_error").info()
    relay, client = Relay([]), Client()
    client.hold.clear()
    task, ends = await _start(relay, client)
    async with asyncio.timeout(5):
        await client.wrote.wait()
        relay.queue.put_nowait(RelayMessage(data=b"a"))
        relay.queue.put_nowait(RelayMessage(data=error_events(err), error=err, final=True))
        await _settle()
        client.hold.set()
        await task
    assert client.body[1] == b"a" + error_events(err)
    assert ends == [Outcome.FAILED]
