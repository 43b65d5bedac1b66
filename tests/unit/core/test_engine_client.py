"""The engine client passes on only what the router can relay (found by tests/fuzz, issue 13):
strict JSON in valid UTF-8, not nested without bound, ``choices`` a list of objects.  Anything else is
an :class:`EngineFailure` (another route before headers, an error event after), never a NaN in a
client's JSON, a UnicodeEncodeError or RecursionError in the relay, or a 500."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.client import MAX_DEPTH, loads_strict, post_json, stream_chunks
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.pipeline import Relay

UNUSABLE = [
    b'{"choices": [], "x": NaN}',
    b'{"x": [-Infinity]}',
    b'{"usage": {"prompt_tokens": 1e999}}',
    b'{"x": ' + b"9" * 400 + b".0}",
    b'{"x": "\\ud800"}',
    b'{"x": {"\\uDFFF": 1}}',
    b'{"x": "\xed\xa0\x80"}',  # a surrogate as raw UTF-8 bytes
    b'{"x": "\xff"}',  # not UTF-8 at all
    b'{"x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # json's own RecursionError
    b'{"x": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",
    b'{"choices": 1}',
    b'{"choices": "ab"}',
    b'{"choices": [1]}',
    b'{"choices": [{"index": 0}, []]}',
]
FINE = [
    b'{"choices": [{"index": 0, "delta": {"content": "\\ud83d\\ude00"}}]}',  # an escaped pair is one character
    b'{"choices": null, "x": 1e308, "y": -0.0, "z": 1e-999, "w": ' + b"1" * 300 + b"}",
    b'{"x": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}",
    b'{"x": "' + b"[{" * 200 + b'"}',  # brackets inside a string are not nesting
]


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


async def _stream(body: bytes) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, stream=httpx.ByteStream(body)))) as c:
        return [chunk async for batch in stream_chunks(c, "e", "http://e/v1/completions", {}, {}) for chunk in batch]


async def _post(status: int, body: bytes) -> dict[str, Any]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(status, stream=httpx.ByteStream(body)))) as c:
        return await post_json(c, "e", "http://e/v1/completions", {}, {})


@pytest.mark.parametrize("payload", UNUSABLE)
async def test_unusable_payloads_are_engine_failures(payload: bytes) -> None:
    with pytest.raises(EngineFailure):
        await _stream(sse(payload))
    if b'"choices"' not in payload:  # (post_json does not look at choices: the prefill answer)
        with pytest.raises(EngineFailure):
            await _post(200, payload)


@pytest.mark.parametrize("payload", FINE)
async def test_fine_payloads_pass(payload: bytes) -> None:
    assert await _stream(sse(payload)) == [json.loads(payload)]
    assert await _post(200, payload) == json.loads(payload)


@pytest.mark.parametrize("bad", [b"{not json", b'{"error": {"message": "engine died", "code": 500}}'])
async def test_the_good_chunks_of_a_read_come_before_its_failure(bad: bytes) -> None:
    """One network read with two tokens and then a broken payload: the tokens are yielded (the
    relay resumes after them), then the failure is raised."""
    body = b"".join(b"data: " + p + b"\n\n" for p in (b'{"choices": [{"index": 0, "text": "a", "token_ids": [1]}]}',
                                                      b'{"choices": [{"index": 0, "text": "b", "token_ids": [2]}]}', bad))
    got: list[list[dict[str, Any]]] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, stream=httpx.ByteStream(body)))) as c:
        with pytest.raises(EngineFailure):
            async for batch in stream_chunks(c, "e", "http://e/v1/completions", {}, {}):
                got.append(batch)
    assert [[ch["choices"][0]["token_ids"] for ch in b] for b in got] == [[[1], [2]]]


def test_loads_strict_keeps_values() -> None:
    assert loads_strict(b'{"a": "\xf0\x9f\x98\x80", "b": [1, 2.5, null, true]}') == {"a": "\U0001F600", "b": [1, 2.5, None, True]}


@pytest.mark.parametrize("body", [
    b'{"error": {"message": "\\ud800 bad", "param": "max_tokens"}}',
    b'{"error": {"message": "bad", "param": "\xed\xa0\x80"}}',
    b'{"error": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
])
async def test_an_error_body_the_router_cannot_relay_is_not_quoted(body: bytes) -> None:
    """The engine's message and param reach the client in a 400: they must be valid Unicode."""
    with pytest.raises(EngineFailure) as ei:
        await _post(400, body)
    assert ei.value.status == 400 and ei.value.upstream_message is None and ei.value.param is None


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("chunk", [b'{"choices": [1]}', b'{"choices": 7}', b'{"choices": [], "x": "\\udc00"}',
                                   b'{"choices": [{"index": 0, "text": "a", "logprobs": NaN}]}'])
async def test_the_relay_answers_502_not_500(stream: bool, chunk: bytes) -> None:
    """On a dialect without token IDs the relay used to crash on these (choices not a list of
    objects) or to send them on (a lone surrogate; NaN): now every candidate fails cleanly."""
    eng = EngineConfig(name="o", url="http://o", dialect="openai")
    req = parse_request("completion", json.dumps({"model": "m", "prompt": "q", "stream": stream}).encode(), model="m")
    placed = PlacedRequest("rid", "m", req, (RouteChoice(kind="single", decode=eng),), time.time() + 30)
    body = b'data: {"choices": [{"index": 0, "text": ""}]}\n\n' + sse(chunk)
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, stream=httpx.ByteStream(body)))) as c:
        msgs = [m async for m in Relay(c).run(placed)]
    last = msgs[-1]
    assert last.final and last.error is not None and last.error.code == "bad_engine_response"
    assert not any(m.data for m in msgs)



async def _late_end_engine(accepted: list[int], ended: list[bool] | None = None) -> asyncio.Server:
    """An engine whose chunked SSE response ends in a later write than its ``data: [DONE]``
    event, as uvicorn's and vLLM's may: the ``0\\r\\n\\r\\n`` terminator follows after 20 ms."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for event in (b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n', b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.02)
                if ended is not None:
                    ended.append(True)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_streamed_completion_leaves_its_engine_connection_in_the_pool() -> None:
    """After ``data: [DONE]`` the client reads the response to its end, so the next request
    reuses the connection: 10 streamed completions, one after another, open one TCP connection
    (before, the stream was closed at ``[DONE]``, and an engine whose response ended in a later
    write got a new connection for every request)."""
    from narwhal_serve.engines import client as client_module
    from narwhal_serve.engines.client import engine_client

    accepted: list[int] = []
    ended: list[bool] = []
    server = await _late_end_engine(accepted, ended)
    port = server.sockets[0].getsockname()[1]
    client = engine_client("aiohttp")
    try:
        for i in range(10):
            body = {"model": "m", "prompt": f"p{i}", "max_tokens": 1, "stream": True}
            batches = [b async for b in stream_chunks(client, "e", f"http://127.0.0.1:{port}/v1/completions", body, {})]
            assert [c["choices"][0]["text"] for b in batches for c in b] == ["a"]
            assert len(ended) == i  # the stream ended at [DONE], not at the later terminator
            await asyncio.wait_for(asyncio.gather(*client_module._DRAINS), 5.0)  # read in the background
            assert len(ended) == i + 1
    finally:
        await client.aclose()
        server.close()
    assert len(accepted) == 1
