"""``narwhal-bench transport``'s checks (:mod:`.transport`), run before the benchmark: the project's
engine-client code paths (``stream_chunks``, ``post_json``) over both httpx variants against an
in-process engine and raw TCP servers — complete streams, failure mapping to ``EngineFailure`` (with
the exception chain that caused it), cancellation closing the upstream connection, and the
connection-pool limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from narwhal_serve.bench import procs
from narwhal_serve.bench.report import table
from narwhal_serve.engines.client import post_json, stream_chunks
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.bench.transport_clients import chat_body, httpx_aiohttp_client, httpx_client, transport_available


# ---- checks ---------------------------------------------------------------------------------------


def exc_chain(exc: BaseException | None, limit: int = 6) -> list[str]:
    """Qualified type names along ``__cause__``/``__context__`` (what raised what)."""
    out: list[str] = []
    while exc is not None and len(out) < limit:
        out.append(f"{type(exc).__module__}.{type(exc).__qualname__}")
        exc = exc.__cause__ or exc.__context__
    return out


@dataclass
class Check:
    name: str
    variant: str
    ok: bool
    detail: str
    chain: list[str] = field(default_factory=list)


class _RawServer:
    """A TCP server on 127.0.0.1 that reads one HTTP request per connection, then does ``mode``:
    ``garbage`` (a non-HTTP status line), ``close`` (closes without answering), ``bad_chunk`` (200
    + one valid SSE event, then an invalid chunk size), ``bad_chunk_late`` (the same, the invalid
    chunk size 0.2 s later, then closes), ``hang`` (never answers; notes the EOF)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.requests = asyncio.Event()
        self.eof_at: list[float] = []
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> _RawServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=1024)
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1/chat/completions"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            self.requests.set()
            if self.mode == "garbage":
                writer.write(b"NOT-HTTP garbage\r\n\r\n")
            elif self.mode in ("bad_chunk", "bad_chunk_late"):
                ev = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                             + f"{len(ev):x}\r\n".encode() + ev + b"\r\n")
                if self.mode == "bad_chunk_late":
                    await writer.drain()
                    await asyncio.sleep(0.2)
                writer.write(b"zz-not-a-size\r\n")
                if self.mode == "bad_chunk_late":
                    await writer.drain()
                    await asyncio.sleep(0.2)
            elif self.mode == "hang":
                await reader.read()  # returns b"" at EOF: the client closed the connection
                self.eof_at.append(time.monotonic())
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


async def _expect_failure(name: str, variant: str, coro: Awaitable[Any], want_status: int | None = None,
                          within_s: float = 5.0) -> Check:
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(coro, within_s)
    except TimeoutError as exc:
        if time.monotonic() - t0 >= within_s:
            return Check(name, variant, False, f"HANG: nothing raised within {within_s:.0f} s", [])
        return Check(name, variant, False, f"ESCAPED (not EngineFailure): {type(exc).__name__}: {exc}", exc_chain(exc))
    except EngineFailure as exc:
        ok = want_status is None or exc.status == want_status
        return Check(name, variant, ok, f"EngineFailure: {exc.message}", exc_chain(exc))
    except Exception as exc:  # noqa: BLE001 - the finding
        return Check(name, variant, False, f"ESCAPED (not EngineFailure): {type(exc).__name__}: {exc}",
                     exc_chain(exc))
    return Check(name, variant, False, "no exception")


async def _drain(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return [c async for batch in stream_chunks(client, "sim", url, body, headers or {}) for c in batch]


def _without_created(chunks: list[dict[str, Any]]) -> str:
    return json.dumps([{k: v for k, v in c.items() if k != "created"} for c in chunks], sort_keys=True)


async def _stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=2.0) as c:
        r = await c.get(url + "/sim/stats")
        out: dict[str, Any] = r.json()
        return out


async def _wait_idle(url: str, timeout_s: float) -> float | None:
    """Seconds until the engine reports nothing running or waiting; None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        st = await _stats(url)
        if st["running"] == 0 and st["waiting"] == 0:
            return time.monotonic() - t0
        await asyncio.sleep(0.01)
    return None


async def _check_variant(v: str, make: Callable[..., httpx.AsyncClient], sim: str, model: str) -> list[Check]:
    chat = sim + "/v1/chat/completions"
    out: list[Check] = []
    async with make() as client:
        # complete streams: every chunk, then [DONE] (stream_chunks only returns normally after it)
        for tokens in (16, 600):
            body = chat_body(model, tokens, seed=7)
            try:
                chunks = await _drain(client, chat, body, {"X-Request-Id": f"check-{tokens}"})
                n_tok = sum(1 for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content"))
                usage = chunks[-1].get("usage") or {}
                ok = n_tok == tokens and usage.get("completion_tokens") == tokens
                out.append(Check(f"stream_{tokens}_tokens", v, ok,
                                 f"{len(chunks)} chunks, {n_tok} token chunks, [DONE] seen",
                                 [_without_created(chunks)]))
            except Exception as exc:  # noqa: BLE001
                out.append(Check(f"stream_{tokens}_tokens", v, False, f"{type(exc).__name__}: {exc}", exc_chain(exc)))
        try:
            obj = await post_json(client, "sim", chat, {**chat_body(model, 8), "stream": False,
                                                        "stream_options": None}, {})
            ok = obj.get("usage", {}).get("completion_tokens") == 8
            out.append(Check("post_json", v, ok, f"object {obj.get('object')}, usage {obj.get('usage')}"))
        except Exception as exc:  # noqa: BLE001
            out.append(Check("post_json", v, False, f"{type(exc).__name__}: {exc}", exc_chain(exc)))

        # failures
        refused = f"http://127.0.0.1:{procs.free_port()}/v1/chat/completions"
        out.append(await _expect_failure("refused_stream", v, _drain(client, refused, chat_body(model, 4))))
        out.append(await _expect_failure("refused_post_json", v, post_json(client, "sim", refused, {}, {})))
        fault: dict[str, Any] = {"sim": {"fault": "error_500"}}
        out.append(await _expect_failure("http_500_stream", v, _drain(client, chat, {**chat_body(model, 4), **fault}),
                                         want_status=500))
        out.append(await _expect_failure("http_500_post_json", v, post_json(
            client, "sim", chat, {**chat_body(model, 4), "stream": False, "stream_options": None, **fault}, {}), want_status=500))
        out.append(await _expect_failure("http_400_stream", v, _drain(client, chat, {**chat_body(model, 4), "n": 2}),
                                         want_status=400))
        fault = {"sim": {"fault": "reset_mid_stream", "fault_after": 3}}
        out.append(await _expect_failure("reset_mid_stream", v,
                                         _drain(client, chat, {**chat_body(model, 16), **fault})))
        out.append(await _expect_failure("reset_mid_body_post_json", v, post_json(
            client, "sim", chat, {**chat_body(model, 16), "stream": False, "stream_options": None, **fault}, {})))
        fault = {"sim": {"fault": "malformed_sse"}}
        out.append(await _expect_failure("malformed_sse", v, _drain(client, chat, {**chat_body(model, 8), **fault})))
        for mode in ("garbage", "close", "bad_chunk", "bad_chunk_late"):
            async with _RawServer(mode) as raw:
                out.append(await _expect_failure(f"raw_{mode}_stream", v, _drain(client, raw.url, chat_body(model, 4))))
                out.append(await _expect_failure(f"raw_{mode}_post_json", v, post_json(client, "sim", raw.url, {}, {})))

        # cancellation mid-stream: the engine must see the disconnect
        got = asyncio.Event()

        async def consume() -> None:
            async for _ in stream_chunks(client, "sim", chat, chat_body(model, 3000), {}):
                got.set()

        task = asyncio.create_task(consume())
        try:
            await asyncio.wait_for(got.wait(), 5.0)
            before = (await _stats(sim))["running"]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            idle = await _wait_idle(sim, 3.0)
            again = await _drain(client, chat, chat_body(model, 4))
            out.append(Check("cancel_mid_stream", v, before == 1 and idle is not None and len(again) > 0,
                             f"engine running before cancel {before}; "
                             f"idle {idle if idle is None else round(idle, 3)} s "
                             f"after; next request on the client ok ({len(again)} chunks)"))
        except Exception as exc:  # noqa: BLE001
            out.append(Check("cancel_mid_stream", v, False, f"{type(exc).__name__}: {exc}", exc_chain(exc)))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        # cancellation before the response head: the server must see EOF
        async with _RawServer("hang") as raw:
            t = asyncio.create_task(_drain(client, raw.url, chat_body(model, 4)))
            await asyncio.wait_for(raw.requests.wait(), 5.0)
            t.cancel()
            t0 = time.monotonic()
            await asyncio.gather(t, return_exceptions=True)
            for _ in range(100):
                if raw.eof_at:
                    break
                await asyncio.sleep(0.01)
            eof = round(raw.eof_at[0] - t0, 3) if raw.eof_at else None
            out.append(Check("cancel_before_head", v, eof is not None, f"server saw EOF after {eof} s"))

    # read timeout (the router sets read=None; the scheduler's scrape client sets one)
    async with make(timeout=httpx.Timeout(5.0, read=0.3)) as client:
        out.append(await _expect_failure("read_timeout_before_head", v, _drain(
            client, chat, {**chat_body(model, 4), "sim": {"fault": "hang"}})))
        out.append(await _expect_failure("read_timeout_mid_stream", v, _drain(
            client, chat, {**chat_body(model, 16), "sim": {"fault": "hang_mid_stream"}})))
    return out


async def _pool_limit(name: str, make: Callable[[], httpx.AsyncClient], n: int = 120) -> Check:
    """Open ``n`` concurrent requests to a server that never answers; count the connections made."""
    async with _RawServer("hang") as raw, make() as client:
        tasks = [asyncio.create_task(post_json(client, "sim", raw.url, {}, {})) for _ in range(n)]
        last, t0 = -1, time.monotonic()
        while raw.connections < n and time.monotonic() - t0 < 10.0:  # until all, or none new for 0.5 s
            if raw.connections == last and last > 0:
                break
            last = raw.connections
            await asyncio.sleep(0.5)
        count = raw.connections
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return Check("pool_limit", name, count == n, f"{count} connections for {n} concurrent requests")


async def run_checks(model: str = "narwhal-sim") -> list[Check]:
    from narwhal_serve.config.sim import SimEngineConfig
    from narwhal_serve.sim.server import start_server

    cfg = SimEngineConfig(model=model, prefill_overhead_s=0.0, prefill_per_token_s=0.0, tpot_base_s=0.001,
                          tpot_per_running_s=0.0, eos_prob=0.0, max_num_seqs=256)
    srv = await start_server(cfg, "127.0.0.1", 0)
    makers: dict[str, Callable[..., httpx.AsyncClient]] = {"httpx": httpx_client}
    if transport_available():
        makers["httpx-aiohttp"] = httpx_aiohttp_client
    try:
        out: list[Check] = []
        for v, make in makers.items():
            out += await _check_variant(v, make, srv.url, model)
    finally:
        await srv.stop()
    streams = {c.name: c.chain[0] for c in out if c.variant == "httpx" and c.name.startswith("stream_") and c.chain}
    for c in out:
        if c.variant != "httpx" and c.name in streams and c.chain:
            same = c.chain[0] == streams[c.name]
            c.ok = c.ok and same
            c.detail += "; chunks identical to httpx's" if same else "; chunks DIFFER from httpx's"
        if c.name.startswith("stream_"):
            c.chain = []
    out.append(await _pool_limit("httpx", httpx_client))
    if transport_available():
        out.append(await _pool_limit("httpx-aiohttp", httpx_aiohttp_client))
        out.append(await _pool_limit("httpx-aiohttp (default session)", lambda: httpx_aiohttp_client(session=None)))
    return out


def checks_table(checks: Sequence[Check]) -> str:
    return table(["check", "variant", "ok", "detail / exception chain"], [
        [c.name, c.variant, "yes" if c.ok else "NO", c.detail + (f"  [{' <- '.join(c.chain)}]" if c.chain else "")]
        for c in checks
    ])
