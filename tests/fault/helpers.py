"""What every fault scenario needs: engine control, the quiescence check, SSE and envelope
assertions, raw HTTP connections (for clients that misbehave on the wire)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx

from tests.fault.conftest import App
from tests.support.graph import Held, balanced, chat_body, status, wait_engine_idle, wait_status
from tests.support.sse import parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_UNSET: Any = object()


# -- engines -----------------------------------------------------------------------------------

async def engine_stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as c:
        out: dict[str, Any] = (await c.get(url + "/sim/stats")).json()
        return out


async def received(app: App) -> dict[str, int]:
    """Requests each engine of ``app`` has received so far."""
    return {n: (await engine_stats(u))["total_requests"] for n, u in app.engines.items()}


async def engine_of(app: App, request_id: str) -> str | None:
    """The engine that received the request with ``X-Request-Id: request_id``."""
    for name, url in app.engines.items():
        if any(r["request_id"] == request_id for r in (await engine_stats(url))["requests"]):
            return name
    return None


async def control(url: str, **cfg: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(url + "/sim/control", json=cfg)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out


@asynccontextmanager
async def engine_set(app: App, name: str, **cfg: Any) -> AsyncIterator[None]:
    """Engine-wide faults and timing (``/sim/control``) on one engine for the block; restored after,
    and the block is left only once the engine is placement-eligible again (breaker closed)."""
    url = app.engines[name]
    async with httpx.AsyncClient(timeout=10) as c:
        saved = (await c.get(url + "/sim/control")).json()
    await control(url, **cfg)
    try:
        yield
    finally:
        await control(url, **{k: saved[k] for k in cfg})
        await wait_usable(app, timeout=20)


@asynccontextmanager
async def fleet_set(app: App, **cfg: Any) -> AsyncIterator[None]:
    """:func:`engine_set` on every engine of ``app``."""
    async with AsyncExitStack() as stack:
        for name in app.engines:
            await stack.enter_async_context(engine_set(app, name, **cfg))
        yield


def _usable(snap: dict[str, Any]) -> bool:
    return all(e["eligible"] and e.get("breaker", "closed") == "closed" for e in snap["engines"])


async def wait_usable(app: App, timeout: float = 20.0) -> dict[str, Any]:
    """Every engine of ``app`` eligible, its breaker closed (if the router has one)."""
    return await wait_status(app.url, _usable, f"every {app.name} engine eligible with its breaker closed", timeout)


async def engine_view(app: App, name: str) -> dict[str, Any]:
    out: dict[str, Any] = next(e for e in (await status(app.url))["engines"] if e["name"] == name)
    return out


async def wait_engine(app: App, name: str, pred: Any, what: str, timeout: float = 15.0) -> dict[str, Any]:
    snap = await wait_status(app.url, lambda s: any(e["name"] == name and pred(e) for e in s["engines"]),
                             f"{name}: {what}", timeout)
    out: dict[str, Any] = next(e for e in snap["engines"] if e["name"] == name)
    return out


# -- the check at the end of every scenario ----------------------------------------------------

def _no_permit_held(snap: dict[str, Any]) -> bool:
    return not any(snap["gauges"].values())


async def assert_quiescent(app: App, *, exact: bool = True, timeout: float = 20.0) -> dict[str, Any]:
    """No leaked permit (every gauge 0, no lease holding one), balanced counters (offered = sum of
    the terminal classes; ``exact=False`` where a restarted scheduler heard of outcomes whose
    arrival its predecessor counted), every engine idle (its requests finished or aborted) and
    back in placement."""
    done = balanced if exact else _no_permit_held
    await wait_status(app.url, done, f"{app.name}: counters balanced, every permit and queue slot back", timeout)
    for url in app.engines.values():
        await wait_engine_idle(url, timeout)
    await wait_usable(app, timeout)
    snap = await status(app.url)
    assert done(snap), (snap["counters"], snap["gauges"])
    assert all(not any(lease["in_use"].values()) for lease in snap["admission_leases"]), snap["admission_leases"]
    return snap


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Counter changes between two /status snapshots, contract names and ``outcome/reason`` pairs."""
    out = {k: after["counters"][k] - before["counters"].get(k, 0) for k in after["counters"]}
    old = {(r["outcome"], r["reason"]): r["count"] for r in before["counters_by_reason"]}
    for r in after["counters_by_reason"]:
        n = r["count"] - old.get((r["outcome"], r["reason"]), 0)
        if n and r["reason"]:  # (completions carry no reason)
            out[f"{r['outcome']}/{r['reason']}"] = n
    return {k: v for k, v in out.items() if v}


# -- requests and what comes back ----------------------------------------------------------------

async def post(app: App, body: dict[str, Any], headers: dict[str, str] | None = None, path: str = CHAT,
               timeout: float = 30.0) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as c:
        return await c.post(app.url + path, json=body, headers=headers or {})


async def timed_post(app: App, body: dict[str, Any], headers: dict[str, str] | None = None,
                     path: str = CHAT) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = await post(app, body, headers, path)
    return r, time.monotonic() - t0


sse_events = parse_sse  # the data payloads of an SSE body: parsed JSON, or the raw string ([DONE])


def assert_clean_end(r: httpx.Response) -> list[Any]:
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events and events[-1] == "[DONE]", events[-3:]
    assert not any(isinstance(e, dict) and "error" in e for e in events), [e for e in events if "error" in e]
    return events


def assert_error_end(r: httpx.Response, code: str | None = None) -> dict[str, Any]:
    """An SSE stream that ended explicitly: one error event in the envelope, then ``[DONE]``."""
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert len(events) >= 2 and events[-1] == "[DONE]", events[-3:]
    assert isinstance(events[-2], dict) and "error" in events[-2], events[-3:]
    err: dict[str, Any] = events[-2]["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_envelope(r: httpx.Response, status_code: int, code: str | None = None,
                    param: Any = _UNSET) -> dict[str, Any]:
    """An error answered in the OpenAI envelope, with ``param`` present (and as given)."""
    assert r.status_code == status_code, (r.status_code, r.text[:500])
    err: dict[str, Any] = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    if code is not None:
        assert err["code"] == code, err
    if param is not _UNSET:
        assert err["param"] == param, err
    return err


def content_events(events: list[Any]) -> int:
    """Chunks that carry generated content."""
    return sum(1 for e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content"))


def long_stream(max_tokens: int, **kw: Any) -> dict[str, Any]:
    return chat_body("a long answer", stream=True, max_tokens=max_tokens, ignore_eos=True, **kw)


class Streaming(Held):
    """A streaming request read in the background (``Held``), waited for with bounds."""

    def __init__(self, app: App, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(app.url + CHAT, body, headers)

    async def first_data(self, timeout: float = 15.0) -> None:
        async with asyncio.timeout(timeout):
            await self.first_chunk.wait()

    async def end(self, timeout: float) -> httpx.Response:
        """Wait (bounded) for the stream to end; the whole exchange as a response."""
        async with asyncio.timeout(timeout):
            r = await self.finished()
        return httpx.Response(r.status_code, content=self.body)


# -- raw HTTP/1.1 ---------------------------------------------------------------------------------

class Raw:
    """One client connection driven byte by byte."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, app: App, rcvbuf: int | None = None, limit: int = 65536) -> Raw:
        host, port = app.host_port
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect: the window the client advertises stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
        return cls(reader, writer)

    @staticmethod
    def head(app: App, path: str, length: int | None, extra: str = "", method: str = "POST") -> bytes:
        host = app.host_port[0]
        lines = [f"{method} {app.prefix}{path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
        if length is not None:
            lines.append(f"Content-Length: {length}")
        return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout: float) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and body (Content-Length framed) of the next response."""
        async with asyncio.timeout(timeout):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            n = int(headers.get("content-length", "0"))
            body = await self.reader.readexactly(n) if n else b""
        return int(lines[0].split()[1]), headers, body

    async def rest(self, timeout: float) -> bytes:
        """Everything until the server closes the connection (bounded)."""
        async with asyncio.timeout(timeout):
            return await self.reader.read(-1)

    def abort(self) -> None:
        """Leave without a goodbye: RST instead of FIN."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    def close(self) -> None:
        self.writer.close()


# -- raw cleartext HTTP/2 --------------------------------------------------------------------------

class H2:
    """One cleartext HTTP/2 connection (prior knowledge, as ``curl --http2-prior-knowledge``; HAProxy
    accepts it on the router's port in direct-ingress mode), driven frame by frame with the ``h2``
    library: several requests at once on it, and a client that cancels one with ``RST_STREAM`` while
    it keeps the connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, app: App) -> None:
        self.reader, self.writer, self.app = reader, writer, app
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.status: dict[int, int] = {}
        self.body: dict[int, bytearray] = {}
        self.ended: set[int] = set()  # streams the server ended (END_STREAM)
        self.reset_by_server: set[int] = set()
        self.closed = False  # the server closed the connection (GOAWAY or EOF)

    @classmethod
    async def open(cls, app: App) -> H2:
        reader, writer = await asyncio.open_connection(*app.host_port)
        out = cls(reader, writer, app)
        out.conn.initiate_connection()
        await out._flush()
        return out

    async def _flush(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def post(self, path: str, body: dict[str, Any]) -> int:
        """Send one whole POST on a new stream; its stream ID."""
        raw = json.dumps(body).encode()
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":path", self.app.prefix + path), (":scheme", "http"),
                                     (":authority", self.app.host_port[0]), ("content-type", "application/json"),
                                     ("content-length", str(len(raw)))])
        self.conn.send_data(sid, raw, end_stream=True)
        self.body[sid] = bytearray()
        await self._flush()
        return sid

    async def reset(self, sid: int) -> None:
        """Cancel one request (``RST_STREAM CANCEL``); the connection stays open."""
        self.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        await self._flush()

    async def until(self, done: Callable[[], bool], what: str, timeout: float) -> None:
        """Read frames (acknowledging data, so flow control never stalls a stream) until ``done()``."""
        async with asyncio.timeout(timeout):
            while not done():
                assert not self.closed, f"the server closed the connection before {what}"
                data = await self.reader.read(65536)
                if not data:
                    self.closed = True
                    continue
                for ev in self.conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived):
                        self.status[ev.stream_id] = int(dict(ev.headers)[":status"])
                    elif isinstance(ev, h2.events.DataReceived):
                        self.body.setdefault(ev.stream_id, bytearray()).extend(ev.data)
                        self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, h2.events.StreamEnded):
                        self.ended.add(ev.stream_id)
                    elif isinstance(ev, h2.events.StreamReset):
                        self.reset_by_server.add(ev.stream_id)
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        self.closed = True
                await self._flush()

    def close(self) -> None:
        self.writer.close()
