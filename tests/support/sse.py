"""Reading an SSE body in tests."""

from __future__ import annotations

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
