"""Reading a request body without ever buffering past ``serving.max_request_bytes``, and the router's own headers."""

from __future__ import annotations

import asyncio
import hmac
import math
import re

from starlette.requests import ClientDisconnect, Request

from narwhal_serve.errors import BodyTimeout, InvalidRequest, RequestTooLarge
from narwhal_serve.runenv import RECEIVED_HEADER, STAMP_KEY_PATTERN

_SECONDS = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")  # a plain decimal number


def header(request: Request, name: str) -> str | None:
    """The value of one of the router's own request headers (None: absent). Sent more than once
    with different values it is a 400 naming it: read as the first value, an intermediary's copy
    appended after a client's was silently overridden by the client's (found by a hostile probe)."""
    values = request.headers.getlist(name)
    if len(values) > 1 and any(v != values[0] for v in values[1:]):
        raise InvalidRequest(f"header {name} was sent more than once with different values", param=name)
    return values[0] if values else None


def seconds_header(request: Request, name: str, zero_is_none: bool = False) -> float | None:
    """A time header's seconds (None: absent; with ``zero_is_none``, also 0); malformed → 400."""
    v = header(request, name)
    if v is None:
        return None
    v = v.strip(" \t")  # (HTTP's optional whitespace only: str.strip and float() take any Unicode space)
    if not _SECONDS.fullmatch(v):  # (float() would take "1_0", "inf", "nan", " 0x" forms)
        raise InvalidRequest(f"header {name} must be a number of seconds", param=name)
    f = float(v)
    if not math.isfinite(f):
        raise InvalidRequest(f"header {name} must be a finite number of seconds", param=name)
    if f == 0 and zero_is_none:
        return None
    if not f > 0:
        raise InvalidRequest(f"header {name} must be positive", param=name)
    return f


_STAMP = re.compile(rf"([0-9]{{1,17}}) ({STAMP_KEY_PATTERN})")


def received_at(request: Request, now: float, limit_s: float, key: str) -> float:
    """When the request reached the router: HAProxy's stamp (runenv.RECEIVED_HEADER: its microseconds
    and the run's ``key``), within [now - limit_s, now] (a clock a little ahead or a stale stamp
    moves nothing past those bounds); ``now`` without one, or with another key."""
    v = request.headers.get(RECEIVED_HEADER)
    m = None if v is None else _STAMP.fullmatch(v)
    if m is None or not hmac.compare_digest(m.group(2), key):
        return now
    return min(now, max(now - limit_s, int(m.group(1)) / 1e6))


class BodyIncomplete(Exception):
    """The client closed or sent less than it announced before the body was complete; ``left``:
    its connection is gone (the server said so), nobody reads an answer."""

    def __init__(self, left: bool = False) -> None:
        super().__init__()
        self.left = left


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """Decide from Content-Length when present, else count while reading (chunked); the whole
    body must arrive within ``timeout_s`` (:class:`BodyTimeout`)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(request, limit)
    except TimeoutError:
        assert timeout_s is not None  # asyncio.timeout(None) never expires
        raise BodyTimeout.after(timeout_s) from None


async def _read(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    expected: int | None = None
    if cl is not None:
        try:
            expected = int(cl)
        except ValueError:
            raise InvalidRequest("Content-Length is not an integer", param=None) from None
        if expected > limit:
            raise RequestTooLarge.over(limit)
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge.over(limit)
            parts.append(chunk)
    except ClientDisconnect:
        raise BodyIncomplete(left=True) from None
    if expected is not None and size < expected:
        raise BodyIncomplete()
    return b"".join(parts)
