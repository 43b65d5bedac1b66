"""Edges of the receipt stamp (``x-narwhal-received-us``): HAProxy stamps each request, the ingress
counts its TTFT and judges its budget from there.  Found by a review of the change; each test
failed before its fix, for the reason its docstring gives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from narwhal_serve.runenv import HAPROXY_BUFSIZE, MAX_HEADER_BYTES, MAX_HEADERS, RECEIVED_HEADER, IngressLimits
from tests.support.local_router import TEST_STAMP_KEY, LocalRouter, start_local_router
from tests.support.haproxy import wrapped_haproxy
from tests.support.spans import install_span_exporter

EXPORTER = install_span_exporter()
CHAT = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _stamp(ago_s: float) -> dict[str, str]:
    return {RECEIVED_HEADER: f"{int((time.time() - ago_s) * 1e6)} {TEST_STAMP_KEY}"}


# -- 1. the stamp was set before the 431 rule: it counted against the client's header limits ------------


@dataclass
class Proxy:
    port: int
    seen: list[int]  # header fields each forwarded request had at the replica


async def _replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[int]) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head.count(b"\r\n") - 2)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Proxy]:
    """The wrapper's HAProxy with the buffer the run gives it (``RAY_SERVE_HAPROXY_TUNE_BUFSIZE`` =
    HAPROXY_BUFSIZE: direct_ingress_env)."""
    seen: list[int] = []
    limits = IngressLimits(max_request_bytes=1000, body_timeout_s=1.5, client_idle_s=2)
    async with wrapped_haproxy(tmp_path, limits, lambda r, w: _replica(r, w, seen), bufsize=HAPROXY_BUFSIZE) as port:
        yield Proxy(port, seen)


async def _status(p: Proxy, head: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(head.encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
        return int(line.split()[1])
    finally:
        writer.close()


async def test_a_client_at_the_header_limits_is_not_refused_431(proxy: Proxy) -> None:
    """docs/contract.md: 431 for request headers "over 15,360 bytes in all, or over 100 fields".
    runenv's wrapper puts ``http-request set-header x-narwhal-received-us`` *before* the 431 rule, so
    ``req.hdr_cnt`` and ``req.hdrs,length`` already count HAProxy's own stamp (one field, 41 bytes):
    a request with exactly 100 fields, or a head of exactly 15,360 bytes, is now refused 431 (both
    got through before the change)."""
    fields = "Host: x\r\n" + "".join(f"x-h{i}: v\r\n" for i in range(MAX_HEADERS - 1))
    assert await _status(proxy, f"GET / HTTP/1.1\r\n{fields}\r\n") == 200, "100 fields: within the limit"
    pad = MAX_HEADER_BYTES - len("Host: x\r\n") - len("x-pad: \r\n") - 2  # (req.hdrs counts the final CRLF)
    assert await _status(proxy, f"GET / HTTP/1.1\r\nHost: x\r\nx-pad: {'a' * pad}\r\n\r\n") == 200, \
        "15,360 bytes: within the limit"
    # (one over each limit is still a 431)
    more = fields + "x-last: v\r\n"
    assert await _status(proxy, f"GET / HTTP/1.1\r\n{more}\r\n") == 431


# -- 2. the request span started at the handler ----------------------------------------------------------


@pytest.fixture(scope="module")
async def traced() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({"observability": {"tracing": True}, "sim": {"engines": [{"name": "u0"}]}},
                                 stamped=True)
    yield r
    await r.stop()


async def test_the_request_span_starts_at_the_receipt(traced: LocalRouter) -> None:
    """The request log's and the span's ``narwhal.duration_s`` / ``narwhal.ttft_s`` (and the admission
    span's ``narwhal.admission_wait_s``) now count from HAProxy's stamp, but observability.py
    ``Observability.trail`` starts the ``narwhal.request`` span when the handler takes the request up:
    a request that waited 0.5 s before the replica shows a span 0.5 s shorter than its own
    ``narwhal.duration_s`` (its wait is missing from the trace, and the TTFT attribute can exceed
    the span).  Fix: start the span (and the admission span) at ``arrived`` (``start_time``)."""
    EXPORTER.clear()
    trace_id = 0x5B8AA5A2D2C872E8321CF37308D69E01
    stamp = _stamp(0.5)
    async with httpx.AsyncClient(base_url=traced.url, timeout=10.0) as c:
        r = await c.post("/v1/chat/completions", json=CHAT,
                         headers={**stamp, "traceparent": f"00-{trace_id:032x}-051581bf3cb55c13-01"})
        assert r.status_code == 200, r.text
    (span,) = [s for s in EXPORTER.get_finished_spans()
               if s.name == "narwhal.request" and s.context is not None and s.context.trace_id == trace_id]
    assert span.start_time is not None and span.end_time is not None and span.attributes is not None
    lasted = (span.end_time - span.start_time) / 1e9
    assert lasted >= span.attributes["narwhal.duration_s"] - 0.01, (lasted, span.attributes["narwhal.duration_s"])
    assert abs(span.start_time / 1e3 - int(stamp[RECEIVED_HEADER].split()[0])) < 50_000  # within 50 ms of the receipt


# -- 3. Retry-After counted time already past -------------------------------------------------------------


@pytest.fixture(scope="module")
async def stamped() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({"sim": {"engines": [{"name": "u0"}]}}, stamped=True)
    yield r
    await r.stop()


async def test_retry_after_is_not_the_wait_already_spent(stamped: LocalRouter) -> None:
    """admission/predictive.py ``judge``: the overrun, and so ``Retry-After`` (and, for a client that
    retries, the reservation decide() books at now + Retry-After), is ``projected + waited - budget``.
    The wait is time already spent: a fresh request sent now (its own receipt) fits the idle engine
    at once, yet a request that waited 30 s of a 1 s budget is told to come back in 29 s (the stamp is
    believed up to ``serving.request_timeout_s``, 600 s by default: Retry-After up to ~10 minutes on an
    idle fleet).  Waiting cures only the projection's part: Retry-After should be
    ``max(1, round(projected - budget))`` as before (the refusal itself is right)."""
    async with httpx.AsyncClient(base_url=stamped.url, timeout=10.0) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={**_stamp(30.0), "X-TTFT-Target": "1"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "ttft_budget_exceeded", r.text
        fresh = await c.post("/v1/chat/completions", json=CHAT, headers={"X-TTFT-Target": "1"})
        assert fresh.status_code == 200, fresh.text  # the engine has room now
    assert int(r.headers["retry-after"]) <= 2, r.headers["retry-after"]
