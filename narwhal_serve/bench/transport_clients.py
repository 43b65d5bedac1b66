"""``narwhal-bench transport``'s client variants (:mod:`.transport`): the engine client's HTTP stacks,
one streamed request each, and a closed loop of them."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx

from narwhal_serve.engines.client import stream_chunks
from narwhal_serve.engines.sse import SSEDecoder

VARIANTS: tuple[str, ...] = ("httpx", "httpx-aiohttp", "aiohttp")
ENGINE_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)  # as engine_client()
ENGINE_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=512)  # as engine_client()
KEEPALIVE_S = 5.0  # httpx's default keepalive_expiry, which engine_client() keeps
_DONE = b"[DONE]"


# ---- clients --------------------------------------------------------------------------------------


def httpx_client(timeout: httpx.Timeout = ENGINE_TIMEOUT) -> httpx.AsyncClient:
    """Plain httpx, as ``engine_client()`` builds it today."""
    return httpx.AsyncClient(timeout=timeout, limits=ENGINE_LIMITS)


def aiohttp_session() -> aiohttp.ClientSession:
    """An aiohttp session without a connection cap (``limit=0``; aiohttp's default is 100, which
    ``AiohttpTransport`` keeps when httpx's ``max_connections`` is None) and no total timeout."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None),
    )


def aiohttp_transport(
    session: Callable[[], aiohttp.ClientSession] | None = aiohttp_session,
) -> httpx.AsyncBaseTransport:
    """``httpx_aiohttp.AiohttpTransport`` (imported lazily: an optional package); ``session=None``
    gives the transport's own default session (connector limit 100)."""
    mod = importlib.import_module("httpx_aiohttp")
    transport: httpx.AsyncBaseTransport = mod.AiohttpTransport() if session is None else mod.AiohttpTransport(
        client=session)
    return transport


def httpx_aiohttp_client(timeout: httpx.Timeout = ENGINE_TIMEOUT,
                         session: Callable[[], aiohttp.ClientSession] | None = aiohttp_session) -> httpx.AsyncClient:
    """The httpx API over aiohttp: what ``engine_client()`` would return with the transport."""
    return httpx.AsyncClient(transport=aiohttp_transport(session), timeout=timeout)


def transport_available() -> str | None:
    """The installed httpx-aiohttp version, or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version("httpx-aiohttp")
    except PackageNotFoundError:
        return None


# ---- one request ----------------------------------------------------------------------------------


def chat_body(model: str, tokens: int, seed: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something about narwhals and their tusks."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    return body


async def one_stream_chunks(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            headers: dict[str, str]) -> tuple[float, int]:
    """(time to first chunk batch, chunks) through the project's ``stream_chunks``."""
    t0 = time.perf_counter()
    first: float | None = None
    n = 0
    async for batch in stream_chunks(client, "sim", url, body, headers):
        if first is None:
            first = time.perf_counter() - t0
        n += len(batch)
    if first is None:
        raise RuntimeError("stream without chunks")
    return first, n


async def one_aiohttp(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      headers: dict[str, str]) -> tuple[float, int]:
    """The same work as ``stream_chunks`` (SSE decode, JSON parse per event) on a bare aiohttp session."""
    t0 = time.perf_counter()
    first: float | None = None
    n = 0
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        dec = SSEDecoder()
        async for raw in resp.content.iter_any():
            got, done = 0, False
            for data in dec.feed(raw):
                if data == _DONE:
                    done = True
                    break
                if not isinstance(json.loads(data), dict):
                    raise RuntimeError("SSE payload is not a JSON object")
                got += 1
            if got:
                n += got
                if first is None:
                    first = time.perf_counter() - t0
            if done:
                if first is None:
                    raise RuntimeError("stream without chunks")
                return first, n
    raise RuntimeError("stream ended without [DONE]")


OneRequest = Callable[[int], Awaitable[tuple[float, int]]]


class Variant:
    """A client variant bound to one engine URL: ``await v.one(i)`` sends request ``i``."""

    def __init__(self, name: str, url: str, body: dict[str, Any]) -> None:
        self.name = name
        self.url = url
        self.body = body
        self._httpx: httpx.AsyncClient | None = None
        self._session: aiohttp.ClientSession | None = None
        if name == "httpx":
            self._httpx = httpx_client()
        elif name == "httpx-aiohttp":
            self._httpx = httpx_aiohttp_client()
        elif name == "aiohttp":
            self._session = aiohttp_session()
        else:
            raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")

    async def one(self, i: int) -> tuple[float, int]:
        headers = {"X-Request-Id": f"tb-{i}"}
        if self._session is not None:
            return await one_aiohttp(self._session, self.url, self.body, headers)
        assert self._httpx is not None
        return await one_stream_chunks(self._httpx, self.url, self.body, headers)

    async def aclose(self) -> None:
        if self._httpx is not None:
            await self._httpx.aclose()
        if self._session is not None:
            await self._session.close()


async def closed_loop(one: OneRequest, n: int, concurrency: int, expect_chunks: int | None,
                      ids: itertools.count[int]) -> tuple[list[float], int, str | None]:
    """``n`` requests by ``concurrency`` workers; (TTFCs of the good ones, errors, first error)."""
    ttfc: list[float] = []
    errors = 0
    sample: str | None = None
    left = n

    async def worker() -> None:
        nonlocal left, errors, sample
        while left > 0:
            left -= 1
            try:
                t, chunks = await one(next(ids))
                if expect_chunks is not None and chunks != expect_chunks:
                    raise RuntimeError(f"{chunks} chunks, expected {expect_chunks}")
                ttfc.append(t)
            except Exception as exc:  # noqa: BLE001 - counted and sampled
                errors += 1
                sample = sample or f"{type(exc).__name__}: {exc}"

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, n)))))
    return ttfc, errors, sample
