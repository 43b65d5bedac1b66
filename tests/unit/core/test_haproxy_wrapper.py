"""The HAProxy wrapper (``narwhal_serve.runenv``) run for real: the bundled HAProxy, started by the
wrapper on a small configuration shaped like the one Ray writes, in front of a stand-in replica.
What it must do for a request with ``Expect: 100-continue``, and for a client that leaves a body
unfinished after the replica's 408."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from narwhal_serve.config import ServingConfig
from narwhal_serve.drain import drain_targets, ingress_limits
from narwhal_serve.runenv import IngressLimits, direct_ingress_env
from tests.support.haproxy import wrapped_haproxy

LIMITS = IngressLimits(max_request_bytes=1000, body_timeout_s=1.5, client_idle_s=2)


@dataclass
class Proxy:
    port: int
    seen: list[dict[str, object]]  # what the stand-in replica received, one entry per request


async def _replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[dict[str, object]]) -> None:
    """Answers 200 with what it read (on ``/slow`` after half a second); on ``/early`` a 408 with ``connection: close`` before reading
    the body (as the router does when a body is late)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            if lines[0].split()[1] == "/early":
                writer.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                await writer.drain()
                await asyncio.sleep(30)  # the replica keeps its side: HAProxy must close the client's
                return
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            seen.append({"expect": headers.get("expect"), "body": len(body)})
            if lines[0].split()[1] == "/slow":  # an answer that takes a while (a model's)
                await asyncio.sleep(0.5)
            out = json.dumps({"body": len(body)}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(out) + out)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Proxy]:
    seen: list[dict[str, object]] = []
    async with wrapped_haproxy(tmp_path, LIMITS, lambda r, w: _replica(r, w, seen)) as port:
        yield Proxy(port, seen)


async def _connect(p: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", p.port)


async def _answer(reader: asyncio.StreamReader, timeout: float) -> tuple[int, dict[str, str], bytes]:
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


def _post(path: str, length: int, expect: bool = True) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
            + ("Expect: 100-continue\r\n" if expect else "") + "\r\n").encode()


async def test_expect_over_the_limit_is_refused_before_the_body_is_invited(proxy: Proxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(_post("/v1/completions", LIMITS.max_request_bytes + 1))
    code, headers, body = await _answer(reader, 5)  # the first answer: no 100 Continue before it
    writer.close()
    assert code == 413, body
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert str(LIMITS.max_request_bytes) in json.loads(body)["error"]["message"]
    assert headers.get("connection") == "close"
    assert proxy.seen == []


async def test_expect_at_the_limit_is_invited_and_a_slow_upload_arrives_whole(proxy: Proxy) -> None:
    """The body comes in three parts over longer than a second (the wait was once 1 s in all)."""
    reader, writer = await _connect(proxy)
    writer.write(_post("/v1/completions", LIMITS.max_request_bytes))
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    third = LIMITS.max_request_bytes // 3
    for part in (third, third, LIMITS.max_request_bytes - 2 * third):
        writer.write(b" " * part)
        await writer.drain()
        await asyncio.sleep(0.6)
    code, _, body = await _answer(reader, 5)
    writer.close()
    assert code == 200 and json.loads(body) == {"body": LIMITS.max_request_bytes}
    # HAProxy answered the expectation: the replica neither sees it nor answers it again
    assert proxy.seen == [{"expect": None, "body": LIMITS.max_request_bytes}]


async def test_expect_on_a_request_without_a_body_never_reaches_the_replica(proxy: Proxy) -> None:
    """A GET (no body, so nothing to wait for) with ``Expect``: HAProxy has nothing to invite, and
    the header must not reach the replica either, whose own interim answer raced its final one
    (CI61's fuzz flake: ``GET /v1/nothing[`` with ``Expect: 100-continue``, its answer cut)."""
    reader, writer = await _connect(proxy)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n")
    code, _, body = await _answer(reader, 5)
    writer.close()
    assert code == 200 and json.loads(body) == {"body": 0}
    assert proxy.seen == [{"expect": None, "body": 0}]


async def test_expect_with_no_body_gets_a_408_envelope_after_the_body_timeout(proxy: Proxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(_post("/v1/completions", 10))
    t0 = time.monotonic()
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    code, headers, body = await _answer(reader, LIMITS.body_timeout_s + 5)
    took = time.monotonic() - t0
    writer.close()
    assert code == 408 and headers.get("content-type") == "application/json", (headers, body)
    err = json.loads(body)["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "request_timeout", None), err
    assert LIMITS.body_timeout_s - 0.2 <= took < LIMITS.body_timeout_s + 2, took
    assert proxy.seen == []


async def test_a_client_that_leaves_its_body_unfinished_after_a_408_is_disconnected(proxy: Proxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(_post("/early", 400, expect=False) + b"{")
    code, _, _ = await _answer(reader, 5)
    quiet = time.monotonic()
    async with asyncio.timeout(LIMITS.client_idle_s + 5):
        rest = await reader.read(-1)  # until HAProxy closes the connection
    took = time.monotonic() - quiet
    writer.close()
    assert code == 408 and rest == b""
    assert took < LIMITS.client_idle_s + 2, took


def test_limits_are_the_most_permissive_application_s() -> None:
    tight = ServingConfig(max_request_bytes=4096, body_timeout_s=1.0, slow_reader_timeout_s=2.0, request_timeout_s=1.5)
    loose = ServingConfig(max_request_bytes=2 << 20, body_timeout_s=12.5, slow_reader_timeout_s=40.0)
    # loose's deadline cap, 600 s; HAProxy's connections: both retention limits and the keep-alives'
    assert IngressLimits.of([tight, loose]) == IngressLimits(2 << 20, 12.5, 601, 3 * 4096)
    assert IngressLimits.of([tight]) == IngressLimits(4096, 1.0, 3, 2 * 4096)
    with pytest.raises(ValueError):
        IngressLimits.of([])


def test_the_client_timeout_is_set_unless_the_operator_set_one(tmp_path: Path) -> None:
    assert direct_ingress_env({}, LIMITS, str(tmp_path))["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] == "2"
    mine = {"RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": "900"}
    assert direct_ingress_env(mine, LIMITS, str(tmp_path))["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"] == "900"


def test_the_run_reads_its_limits_from_its_config(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("""applications:
  - name: a
    route_prefix: /a
    args: {serving: {max_request_bytes: 5000, body_timeout_s: 3, drain_grace_s: 7}}
  - name: b
    route_prefix: /b
    args: {serving: {slow_reader_timeout_s: 9}}
""")
    targets = drain_targets([str(cfg)], log=lambda _: None)
    assert [t.grace_s for t in targets] == [7.0, ServingConfig().drain_grace_s]
    default = ServingConfig()
    assert ingress_limits(targets) == IngressLimits(default.max_request_bytes, default.body_timeout_s,
                                                    int(default.request_timeout_s) + 1, 3 * 4096)
    assert ingress_limits([]) == IngressLimits.of([default])
    # an application whose serving section is bad is left out; the others still count
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [{name: a, args: {serving: {body_timeout_s: -1}}},\n"
                   "               {name: b, route_prefix: /b, args: {serving: {max_request_bytes: 7000000}}}]\n")
    said: list[str] = []
    kept = drain_targets([str(bad)], log=said.append)
    assert [t.base.rsplit("/", 1)[1] for t in kept] == ["b"] and "'a' skipped" in said[0]
    assert ingress_limits(kept).max_request_bytes == 7000000
    unreadable = tmp_path / "unreadable.yaml"
    unreadable.write_text("applications: [\n")
    said.clear()
    assert drain_targets([str(unreadable)], log=said.append) == [] and "default serving limits" in said[0]


async def test_a_client_that_half_closes_after_its_request_gets_the_envelope(proxy: Proxy) -> None:
    """(Found by a hostile probe.) A whole request, then the client's side shut (``nc -N``): with
    Ray's ``option abortonclose`` HAProxy drops it as a client gone and answers 400 itself — in
    the envelope, saying why, not its HTML page."""
    reader, writer = await _connect(proxy)
    body = b'{"model": "m"}'
    writer.write(_post("/slow", len(body), expect=False) + body)
    await writer.drain()
    writer.write_eof()
    code, headers, raw = await _answer(reader, 5)
    writer.close()
    assert code == 400 and headers.get("content-type") == "application/json", raw
    err = json.loads(raw)["error"]
    assert err["code"] == "invalid_request" and "half-close" in err["message"]
