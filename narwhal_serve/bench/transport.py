"""``narwhal-bench transport``: the engine client's HTTP stack, compared in one run.

One simulated engine runs as a subprocess (no prefill cost, ``--tpot-s`` per token, default 0), so
that ``time.process_time`` of this process is the client's CPU alone.  Against it, each variant

* ``httpx``: ``httpx.AsyncClient`` configured as ``deployments/assembler.py`` ``engine_client()``;
* ``httpx-aiohttp``: the same client API over ``httpx_aiohttp.AiohttpTransport`` (an unlimited
  aiohttp connector, see :func:`aiohttp_session`);
* ``aiohttp``: a bare ``aiohttp.ClientSession`` with an equivalent minimal SSE loop (the floor);

sends closed-loop streaming chat completions (``--tokens`` tokens each).  The httpx variants go
through the project's own :func:`narwhal_serve.engines.client.stream_chunks`.  Phases are
``(round, concurrency, variant)``; within a round and concurrency the variants run in an order
rotated every round (see :func:`schedule`), so machine noise hits all alike.  Every phase is
preceded by an unmeasured warm-up at the same concurrency (the pool holds its connections).

Reported per concurrency and variant: time to first chunk (p50/p99), requests/s, client CPU per
request (``process_time`` delta / requests) and the engine's CPU per request (``/proc``).

Before the benchmark, unless ``--skip-checks``, :func:`run_checks` runs the project's code paths
(``stream_chunks``, ``post_json``) over both httpx variants against an in-process engine and raw
TCP servers: complete streams, failure mapping to ``EngineFailure`` (with the exception chain that
caused it), cancellation closing the upstream connection, and the connection-pool limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from narwhal_serve.bench import procs
from narwhal_serve.bench.report import table, write_json
from narwhal_serve.bench.stats import percentile
from narwhal_serve.engines.client import post_json, stream_chunks
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.engines.sse import SSEDecoder

VARIANTS: tuple[str, ...] = ("httpx", "httpx-aiohttp", "aiohttp")
ENGINE_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)  # as engine_client()
ENGINE_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=512)  # as engine_client()
KEEPALIVE_S = 5.0  # httpx's default keepalive_expiry, which engine_client() keeps
_DONE = b"[DONE]"

DEFINITIONS = {
    "ttfc": "send -> first batch of parsed chunks yielded (the role chunk), client side",
    "rps": "completed requests / summed wall time of the measured phases (closed loop)",
    "client_cpu_ms": "time.process_time() delta of the bench process over the measured phases / requests sent",
    "engine_cpu_ms": "CPU of the simulated engine process (/proc) over the measured phases / requests sent",
    "rounds": "each round runs every variant once per concurrency, in an order rotated every round",
}


# ---- schedule and summary (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    round: int
    concurrency: int
    variant: str


def rotated(items: Sequence[str], k: int) -> list[str]:
    """``items`` rotated left by ``k`` (mod its length)."""
    if not items:
        return []
    k %= len(items)
    return [*items[k:], *items[:k]]


def schedule(variants: Sequence[str], concurrencies: Sequence[int], rounds: int) -> list[Phase]:
    """Rounds, each: for every concurrency, every variant once, rotated by ``round + concurrency index``.

    With ``rounds`` a multiple of ``len(variants)`` every variant runs in every position equally
    often at every concurrency, and the variant that opens a concurrency changes with it too."""
    return [
        Phase(r, c, v)
        for r in range(rounds)
        for ci, c in enumerate(concurrencies)
        for v in rotated(list(variants), r + ci)
    ]


@dataclass
class PhaseResult:
    phase: Phase
    sent: int
    errors: int
    wall_s: float
    cpu_s: float
    engine_cpu_s: float | None = None
    ttfc_s: list[float] = field(default_factory=list)
    error_sample: str | None = None

    @property
    def ok(self) -> int:
        return self.sent - self.errors

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttfc_s"] = [round(x, 6) for x in self.ttfc_s]
        return d


def _ms(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v * 1000.0, nd)


def summarize(results: Sequence[PhaseResult], baseline: str = "httpx") -> list[dict[str, Any]]:
    """One row per (concurrency, variant), ordered by concurrency, then as in :data:`VARIANTS`.

    TTFC percentiles pool every measured request; ``rps`` and CPU per request sum over rounds (so
    a round with more requests weighs more); ``*_rounds`` keep each round's value to show spread;
    ``cpu_vs_<baseline>`` is the client CPU per request relative to ``baseline`` at that concurrency.
    """
    groups: dict[tuple[int, str], list[PhaseResult]] = {}
    for r in results:
        groups.setdefault((r.phase.concurrency, r.phase.variant), []).append(r)
    rows: list[dict[str, Any]] = []
    def order(key: tuple[int, str]) -> tuple[int, int]:
        return key[0], VARIANTS.index(key[1]) if key[1] in VARIANTS else len(VARIANTS)

    for (c, v), rs in sorted(groups.items(), key=lambda kv: order(kv[0])):  # stable among unknown variants
        sent = sum(r.sent for r in rs)
        ok = sum(r.ok for r in rs)
        wall = sum(r.wall_s for r in rs)
        cpu = sum(r.cpu_s for r in rs)
        eng = [r.engine_cpu_s for r in rs]
        ttfc = [x for r in rs for x in r.ttfc_s]
        rows.append({
            "concurrency": c,
            "variant": v,
            "rounds": len(rs),
            "sent": sent,
            "errors": sent - ok,
            "ttfc_p50_ms": _ms(percentile(ttfc, 50)),
            "ttfc_p99_ms": _ms(percentile(ttfc, 99)),
            "rps": round(ok / wall, 1) if wall > 0 else None,
            "client_cpu_ms": _ms(cpu / sent) if sent else None,
            "engine_cpu_ms": _ms(sum(e for e in eng if e is not None) / sent)
            if sent and all(e is not None for e in eng) else None,
            "rps_rounds": [round(r.ok / r.wall_s, 1) if r.wall_s > 0 else None for r in rs],
            "client_cpu_ms_rounds": [_ms(r.cpu_s / r.sent) if r.sent else None for r in rs],
            "error_sample": next((r.error_sample for r in rs if r.error_sample), None),
        })
    base = {row["concurrency"]: row["client_cpu_ms"] for row in rows if row["variant"] == baseline}
    for row in rows:
        b, x = base.get(row["concurrency"]), row["client_cpu_ms"]
        row[f"cpu_vs_{baseline}"] = round(x / b, 2) if b and x is not None else None
    return rows


def summary_table(rows: Sequence[dict[str, Any]], baseline: str = "httpx") -> str:
    def spread(xs: Sequence[float | None]) -> str:
        vs = [x for x in xs if x is not None]
        return f"{min(vs):.2f}-{max(vs):.2f}" if vs else "-"

    headers = ["conc", "variant", "n", "err", "TTFC p50 ms", "TTFC p99 ms", "req/s", "client CPU ms/req",
               "(rounds)", f"CPU vs {baseline}", "engine CPU ms/req"]
    return table(headers, [
        [r["concurrency"], r["variant"], r["sent"], r["errors"], r["ttfc_p50_ms"], r["ttfc_p99_ms"], r["rps"],
         r["client_cpu_ms"], spread(r["client_cpu_ms_rounds"]), r[f"cpu_vs_{baseline}"], r["engine_cpu_ms"]]
        for r in rows
    ])


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
            client, "sim", chat, {**chat_body(model, 4), "stream": False, **fault}, {}), want_status=500))
        out.append(await _expect_failure("http_400_stream", v, _drain(client, chat, {**chat_body(model, 4), "n": 2}),
                                         want_status=400))
        fault = {"sim": {"fault": "reset_mid_stream", "fault_after": 3}}
        out.append(await _expect_failure("reset_mid_stream", v,
                                         _drain(client, chat, {**chat_body(model, 16), **fault})))
        out.append(await _expect_failure("reset_mid_body_post_json", v, post_json(
            client, "sim", chat, {**chat_body(model, 16), "stream": False, **fault}, {})))
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


# ---- the run ----------------------------------------------------------------------------------------


@dataclass
class TransportArgs:
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    concurrencies: list[int] = field(default_factory=lambda: [1, 8, 32])
    rounds: int = 3
    requests: int = 500  # measured per phase
    warmup: int = 32  # unmeasured, before each phase (at least the concurrency)
    tokens: int = 16
    tpot_s: float = 0.0
    model: str = "narwhal-sim"
    checks: bool = True


def _engine_cpu(sim: procs.Managed) -> float:
    return sum(cpu for _, cpu in procs.tree_cpu(sim.pid).values())


async def bench(a: TransportArgs, url: str, sim: procs.Managed | None,
                progress: Callable[[str], None] = lambda s: None) -> list[PhaseResult]:
    body = chat_body(a.model, a.tokens)
    variants = {v: Variant(v, url + "/v1/chat/completions", body) for v in a.variants}
    ids = itertools.count()
    try:
        _, expect = await variants[a.variants[0]].one(next(ids))
        results: list[PhaseResult] = []
        plan = schedule(a.variants, a.concurrencies, a.rounds)
        for i, ph in enumerate(plan):
            v = variants[ph.variant]
            await closed_loop(v.one, max(a.warmup, ph.concurrency), ph.concurrency, None, ids)
            e0 = _engine_cpu(sim) if sim is not None else None
            c0, t0 = time.process_time(), time.perf_counter()
            ttfc, errors, sample = await closed_loop(v.one, a.requests, ph.concurrency, expect, ids)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            e1 = _engine_cpu(sim) if sim is not None else None
            eng = None if e0 is None or e1 is None else e1 - e0
            results.append(PhaseResult(ph, a.requests, errors, wall, cpu, eng, ttfc, sample))
            progress(f"[{i + 1}/{len(plan)}] round {ph.round} c={ph.concurrency} {ph.variant}: "
                     f"{(a.requests - errors) / wall:.0f} req/s, {1000 * cpu / a.requests:.2f} ms CPU/req, "
                     f"{errors} errors")
        return results
    finally:
        for v in variants.values():
            await v.aclose()


def _stderr(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def run(a: TransportArgs, out: Path, loop: str = "uvloop") -> dict[str, Any]:
    """Checks (in-process engine), then the benchmark against a subprocess engine; write
    ``results.json`` in ``out``; return the results."""
    if "httpx-aiohttp" in a.variants and not transport_available():
        _stderr("httpx-aiohttp is not installed: variant httpx-aiohttp skipped")
        a.variants = [v for v in a.variants if v != "httpx-aiohttp"]
    t0 = time.monotonic()
    runner = _runner(loop)
    checks: list[Check] = []
    if a.checks:
        with runner() as r:
            checks = r.run(run_checks(a.model))
        _stderr(checks_table(checks))
    port = procs.free_port()
    argv = procs.python_module(
        "narwhal_serve.sim.cli", "--port", str(port), "--role", "unified", "--model", a.model, "--eos-prob", "0",
        "--prefill-overhead-s", "0", "--prefill-per-token-s", "0", "--tpot-base-s", str(a.tpot_s),
        "--tpot-per-running-s", "0", "--max-num-seqs", str(max(256, *a.concurrencies)))
    sim = procs.start("sim", argv, out / "logs")
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_ready(url + "/health", 30.0, sim)
        with runner() as r:
            phases = r.run(bench(a, url, sim, _stderr))
    finally:
        sim.stop()
    rows = summarize(phases)
    res: dict[str, Any] = {
        "meta": {"mode": "transport", "args": asdict(a), "loop": loop, "httpx": httpx.__version__,
                 "aiohttp": aiohttp.__version__, "httpx_aiohttp": transport_available(),
                 "python": sys.version.split()[0], "wall_s": round(time.monotonic() - t0, 1)},
        "definitions": DEFINITIONS,
        "summary": rows,
        "checks": [asdict(c) for c in checks],
        "phases": [p.to_json() for p in phases],
    }
    write_json(out / "results.json", res)
    return res


def _runner(loop: str) -> Callable[[], asyncio.Runner]:
    if loop == "uvloop":
        try:
            import uvloop

            return lambda: asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            _stderr("uvloop not installed: using asyncio's loop")
    return asyncio.Runner

