"""Reading a request body: what ended it early is told apart (the client left, or said more than it sent)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import Request

from narwhal_serve.errors import RequestTooLarge
from narwhal_serve.gateway.body import BodyIncomplete, read_body


def request(messages: list[dict[str, Any]], length: int | None) -> Request:
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    it = iter(messages)

    async def receive() -> dict[str, Any]:
        return next(it)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}, receive)


async def test_a_whole_body_in_parts() -> None:
    parts = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"c"}]
    assert await read_body(request(parts, 3), 10) == b"abc"


async def test_a_client_that_leaves_mid_body_is_told_apart_from_a_short_body() -> None:
    left = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}]
    with pytest.raises(BodyIncomplete) as gone:
        await read_body(request(left, 10), 100)
    assert gone.value.left
    with pytest.raises(BodyIncomplete) as short:
        await read_body(request([{"type": "http.request", "body": b"ab"}], 10), 100)
    assert not short.value.left


async def test_a_body_past_the_limit_is_refused_while_it_is_read() -> None:
    parts = [{"type": "http.request", "body": b"x" * 8, "more_body": True}] * 3
    with pytest.raises(RequestTooLarge):
        await read_body(request(parts, None), 20)
