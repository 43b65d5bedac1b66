"""Reading a request body without ever buffering past ``serving.max_request_bytes``, and the router's own headers."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from narwhal_serve.errors import BodyTimeout, InvalidRequest, RequestTooLarge


def header(request: Request, name: str) -> str | None:
    """The value of one of the router's own request headers (None: absent). Sent more than once
    with different values it is a 400 naming it: read as the first value, an intermediary's copy
    appended after a client's was silently overridden by the client's (found by a hostile probe)."""
    values = request.headers.getlist(name)
    if len(values) > 1 and any(v != values[0] for v in values[1:]):
        raise InvalidRequest(f"header {name} was sent more than once with different values", param=name)
    return values[0] if values else None


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
