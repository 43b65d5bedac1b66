"""Reading an SSE body in tests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx


def parse_sse(text: str) -> list[Any]:
    """Data payloads of an SSE body: parsed JSON, or the raw string (``[DONE]``, malformed lines)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                try:
                    out.append(json.loads(payload))
                except ValueError:
                    out.append(payload)
    return out


class OneRead(httpx.AsyncByteStream):
    """A streamed body that arrives in one network read (an engine's whole SSE answer at once)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield self.data


def sse_response(data: bytes) -> httpx.Response:
    """An engine's streamed answer: ``data`` as a ``text/event-stream`` body, read once."""
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=OneRead(data))


# -- an engine's streamed answers, for relay tests over httpx.MockTransport --------------------------


def sse_bytes(*chunks: dict[str, Any], done: bool = True) -> bytes:
    """``chunks`` as SSE events, then ``[DONE]`` unless ``done`` is false (a stream cut short)."""
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chat_token(text: str, tid: int, finish: str | None = None) -> dict[str, Any]:
    """A vLLM chat chunk of one token with its ID."""
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish,
                         "stop_reason": None, "token_ids": [tid]}]}


def completion_token(text: str, tid: int, finish: str | None = None) -> dict[str, Any]:
    """A vLLM completion chunk of one token with its ID (a mid-stream resume's continuation)."""
    return {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                         "token_ids": [tid], "prompt_token_ids": None}]}


def chat_role(prompt_ids: list[int]) -> dict[str, Any]:
    """vLLM's first chat chunk: the role, with the prompt's token IDs."""
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "prompt_token_ids": prompt_ids,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


class ReadsApart(httpx.AsyncByteStream):
    """A body in reads ``gap_s`` apart; ``broken``: the connection then drops (an engine dying);
    ``close_fails``: closing it raises (a connection whose close fails, or is interrupted)."""

    def __init__(self, *parts: bytes, broken: bool = False, close_fails: bool = False, gap_s: float = 0.01) -> None:
        self.parts, self.broken, self.close_fails, self.gap_s = parts, broken, close_fails, gap_s

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for i, p in enumerate(self.parts):
            if i:
                await asyncio.sleep(self.gap_s)
            yield p
        if self.broken:
            raise httpx.ReadError("connection reset")

    async def aclose(self) -> None:
        if self.close_fails:
            raise RuntimeError("closing the engine connection failed")
