"""Review of the streaming path (gateway/streaming.py RelayStreamResponse): each test shows a
behaviour docs/contract.md ("Streaming and assembly", "Errors") promises, or an OpenAI client needs,
that the code does not keep yet."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from narwhal_serve.gateway.streaming import Flow, RelayStreamResponse, drained_error
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.protocol.sse import sse_event
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.messages import RelayMessage
from tests.support.sse import parse_sse

META = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
PROMPT_TOKENS = 3


def token_event(text: str) -> bytes:
    return sse_event({**META, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


def finish_event() -> bytes:
    return sse_event({**META, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})


def engine_usage_event(completion_tokens: int) -> bytes:
    """The engine's own usage-only chunk (stream_options.include_usage), as the relay passes it on."""
    return sse_event({**META, "choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": completion_tokens,
                                                       "total_tokens": PROMPT_TOKENS + completion_tokens}})


def first_message() -> RelayMessage:
    """The relay's first message of a stream whose client asked for usage (pipeline.py _stream)."""
    return RelayMessage(data=token_event("a"), first_token=True, engines=("e1",), tokens=1,
                        usage_meta=(dict(META), PROMPT_TOKENS))


class Relay:
    """The relay's later messages: ``msgs``, then ``end``: "hang" (waits, as for an engine that has
    not sent its [DONE] yet), "raise" (a fault in the router's relay), "stop" (ends without its final
    message)."""

    def __init__(self, msgs: list[RelayMessage], end: str) -> None:
        self.msgs, self.end = list(msgs), end
        self.closed = asyncio.Event()

    def __aiter__(self) -> "Relay":
        return self

    async def __anext__(self) -> RelayMessage:
        await asyncio.sleep(0)
        if self.msgs:
            return self.msgs.pop(0)
        if self.end == "raise":
            raise RuntimeError("a fault in the router between chunks")
        if self.end == "stop":
            raise StopAsyncIteration
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed.set()


class Client:
    """An ASGI ``send`` that records the body."""

    def __init__(self) -> None:
        self.body = b""
        self.wrote = asyncio.Event()

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            return
        self.body += message["body"]
        self.wrote.set()


Ends = list[tuple[Outcome, str, RelayStats | None]]


def response(relay: Relay, ends: Ends, **kw: Any) -> RelayStreamResponse:
    first = first_message()
    flow = Flow(lambda m: None, lambda o, r, st, code: ends.append((o, r, st)))
    flow.observe(first)  # (completion.py _first_data observes the first message)
    gen: AsyncIterator[RelayMessage] = relay
    return RelayStreamResponse(first, gen, flow, 60.0, {}, **kw)


async def _receive() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


def usage_chunks(body: bytes) -> list[dict[str, Any]]:
    return [e for e in parse_sse(body.decode()) if isinstance(e, dict) and e.get("usage") is not None]


# --- 1. a drain cut writes a second usage chunk -----------------------------------------------------

async def test_a_drain_cut_after_the_engines_usage_chunk_does_not_write_a_second_one() -> None:
    """docs/contract.md "Errors": a stream that asked for ``include_usage`` gets *a* usage chunk before
    ``[DONE]``; OpenAI's stream has exactly one (usage "for the entire request"), and clients that add
    usage up over a stream's chunks (LangChain's usage_metadata) count it twice.  streaming.py ``cut``
    (the drain's end, completion.py ``end_streams``) writes its own computed usage chunk whenever the
    first message carried ``usage_meta``, even after the engine's own usage chunk went out (vLLM sends
    it and ``[DONE]`` in separate writes; the drain's grace ends between them)."""
    relay = Relay([RelayMessage(data=finish_event() + engine_usage_event(1), tokens=1, usage_sent=True)], end="hang")
    ends: Ends = []
    client = Client()
    resp = response(relay, ends)
    async with asyncio.timeout(10):
        task = asyncio.create_task(resp({"type": "http"}, _receive, client))
        while b'"usage"' not in client.body:  # the engine's usage chunk reached the client
            client.wrote.clear()
            await client.wrote.wait()
        resp.cut(drained_error())  # the drain's grace ends before the engine's [DONE]
        await task
    events = parse_sse(client.body.decode())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "router_draining", events
    assert len(usage_chunks(client.body)) == 1, f"usage chunks written: {usage_chunks(client.body)}"


# --- 2. a router fault mid-stream ends without the usage chunk the client asked for ---------------

@pytest.mark.parametrize("end", ["raise", "stop"])
async def test_a_relay_fault_mid_stream_still_writes_the_usage_chunk_the_client_asked_for(end: str) -> None:
    """docs/contract.md "Errors": "A stream that asked for stream_options.include_usage gets a usage
    chunk before [DONE] even when the engine sent none (computed from the prompt's token IDs, or its
    size estimate, and the measured output tokens)" — kept by the relay's failure paths and by the
    drain's cut (test_drain.py: "as on every other failure path").  streaming.py ``_read`` ends a relay
    that raised (or ended without its final message) with ``_failure``: the error event and ``[DONE]``
    only, without the usage chunk, though ``usage_meta`` and the tokens so far are at hand."""
    relay = Relay([RelayMessage(data=token_event("b"), tokens=2)], end=end)
    ends: Ends = []
    client = Client()
    async with asyncio.timeout(10):
        await response(relay, ends)({"type": "http"}, _receive, client)
    events = parse_sse(client.body.decode())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error", events
    usage = usage_chunks(client.body)
    assert len(usage) == 1, f"no usage chunk before the error event: {events}"
    assert usage[0]["usage"]["prompt_tokens"] == PROMPT_TOKENS and usage[0]["usage"]["completion_tokens"] == 2
    assert ends and ends[0][0] is Outcome.FAILED



async def test_the_relay_marks_the_message_that_carries_the_engines_usage_chunk() -> None:
    """What the stream's ending reads (RelayMessage.usage_sent): set by the relay on the message
    whose data holds the engine's usage chunk, and on none before it."""
    import json as _json

    import httpx

    from tests.unit.test_dialect_shapes import placed, run, sse

    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}

    def ch(text: str, ids: list[int], fin: str | None = None) -> dict[str, object]:
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": fin,
                                     "token_ids": ids}]}

    usage = {**head, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    body = sse(ch("a", [5]), ch("b", [6], "length"), usage)
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(body)),
                        placed("completion", "vllm", stream=True, body={"stream_options": {"include_usage": True}}))
    carrying = [m for m in msgs if b'"usage"' in m.data]
    assert carrying and all(m.usage_sent for m in carrying), [(m.data, m.usage_sent) for m in msgs]
    assert not any(m.usage_sent for m in msgs[:msgs.index(carrying[0])])
    events = [e for e in carrying[0].data.split(b"\n\n") if e.startswith(b"data: {")]
    assert [_json.loads(e[6:]).get("usage", {}).get("completion_tokens") for e in events if b'"usage"' in e] == [2]


async def test_a_slow_closing_write_after_done_is_no_slow_reader() -> None:
    """The answer was handed over whole ([DONE] written) and only the closing empty write outlasted
    the write timeout: the stream was cut as a slow reader — an error event and a second [DONE]
    after the first, and a completed answer counted failed/slow_reader."""

    class Stuck(Client):
        async def __call__(self, message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", True) and not message["body"]:
                await asyncio.Event().wait()  # the closing write never completes
            await super().__call__(message)

    relay = Relay([RelayMessage(data=finish_event() + b"data: [DONE]\n\n", final=True, tokens=1)], end="hang")
    ends: Ends = []
    client = Stuck()
    async with asyncio.timeout(10):
        await response(relay, ends, write_timeout_s=0.05)({"type": "http"}, _receive, client)
    assert client.body.count(b"[DONE]") == 1 and b'"error"' not in client.body, client.body
    assert [(o, r) for o, r, _ in ends] == [(Outcome.COMPLETED, "")]


async def test_a_cut_after_a_first_message_that_carried_the_engines_usage_writes_no_second_one() -> None:
    """A short answer's first message may carry the engine's usage chunk too (one read): the
    stream's ending read usage_sent only from later messages."""
    first = RelayMessage(data=token_event("a") + finish_event() + engine_usage_event(1), first_token=True,
                         engines=("e1",), tokens=1, usage_meta=(dict(META), PROMPT_TOKENS), usage_sent=True)
    ends: Ends = []
    flow = Flow(lambda m: None, lambda o, r, st, code: ends.append((o, r, st)))
    flow.observe(first)
    client = Client()
    resp = RelayStreamResponse(first, Relay([], end="hang"), flow, 60.0, {})
    async with asyncio.timeout(10):
        task = asyncio.create_task(resp({"type": "http"}, _receive, client))
        while b'"usage"' not in client.body:
            client.wrote.clear()
            await client.wrote.wait()
        resp.cut(drained_error())
        await task
    assert len(usage_chunks(client.body)) == 1, usage_chunks(client.body)


def test_usage_on_every_chunk_is_not_the_streams_usage_chunk() -> None:
    """With ``continuous_usage_stats`` every chunk carries usage, and the engine still ends with its
    usage-only chunk: the relay counted the first chunk as it (no usage chunk on a failure after),
    the gateway's ending only the usage-only one — one rule now."""
    from narwhal_serve.relay.attempt import UsageWatch

    watch = UsageWatch(3)
    watch.observe({**META, "choices": [{"index": 0, "delta": {"content": "a"}}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    assert not watch.seen
    watch.observe({**META, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    assert watch.seen
