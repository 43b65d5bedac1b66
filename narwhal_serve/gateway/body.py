"""Reading a request body without ever buffering past ``serving.max_request_bytes``."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from narwhal_serve.errors import BodyTimeout, InvalidRequest, RequestTooLarge


class BodyIncomplete(Exception):
    """The client closed or sent less than it announced before the body was complete."""


def too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"The request body exceeds the limit of {limit} bytes.", param=None)


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """Decide from Content-Length when present, else count while reading (chunked); the whole
    body must arrive within ``timeout_s`` (:class:`BodyTimeout`)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(request, limit)
    except TimeoutError:
        raise BodyTimeout(f"The request body did not arrive within {timeout_s:g} s.", param=None) from None


async def _read(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    expected: int | None = None
    if cl is not None:
        try:
            expected = int(cl)
        except ValueError:
            raise InvalidRequest("Content-Length is not an integer", param=None) from None
        if expected > limit:
            raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            parts.append(chunk)
    except ClientDisconnect:
        raise BodyIncomplete() from None
    if expected is not None and size < expected:
        raise BodyIncomplete()
    return b"".join(parts)
