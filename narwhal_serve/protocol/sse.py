"""Server-Sent Events as the router and the simulator write them: one ``data:`` event per JSON
object, the ``[DONE]`` sentinel, and the error event that ends a stream (the envelope, then
``[DONE]``: a stream never ends silently)."""

from __future__ import annotations

import json
from typing import Any

from narwhal_serve.errors import ErrorInfo

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_events(err: ErrorInfo) -> bytes:
    """The end of a stream that failed: the error envelope as one event, then ``[DONE]``."""
    return sse_event(err.body()) + DONE_EVENT
