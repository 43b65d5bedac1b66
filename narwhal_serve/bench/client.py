"""The load generator: one request (:func:`send_one`), open-loop and closed-loop runs.

aiohttp, not httpx: on this 2-core VM an aiohttp streaming client costs ~1.5 ms CPU per request
against ~5 ms for httpx (measured), and the generator shares the cores with what it measures.
Every run is bounded in count (its specs) and time (window + drain; stragglers are cancelled and
reported as ``cut``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from narwhal_serve.bench.progress import Progress
from narwhal_serve.bench.stats import RequestResult
from narwhal_serve.bench.workload import Api, RequestSpec, api_path, build_body


@dataclass(frozen=True)
class Endpoint:
    """Where a target listens: one base URL, or several taken round-robin by request index."""

    name: str
    urls: tuple[str, ...]
    headers: tuple[tuple[str, str], ...] = ()

    def url_for(self, idx: int, api: Api) -> str:
        return self.urls[idx % len(self.urls)].rstrip("/") + api_path(api)


@dataclass(frozen=True)
class Shape:
    """What every request of a run looks like besides its spec."""

    api: Api = "chat"
    model: str = "narwhal-sim"
    stream: bool = True
    timeout_s: float = 60.0
    extra_headers: tuple[tuple[str, str], ...] = ()
    include_usage: bool = True  # streaming: ask for the usage chunk (stream_options.include_usage)


PREDICTED_TTFT_HEADER = "X-Narwhal-Predicted-TTFT"


RETRY_COUNT_HEADER = "X-Stainless-Retry-Count"  # what the official OpenAI SDKs send (0, then the retry count)


@dataclass
class RetryPolicy:
    """Which clients retry a refusal once after its Retry-After (the Retry-After accuracy sample).

    ``wants(idx)``: whether request ``idx``'s client is a retrying one (drawn with ``probability``,
    the same draw for every target); it says so as the OpenAI SDKs do, with
    ``X-Stainless-Retry-Count: 0`` (and 1 on its retry), so a router may keep room for it.
    ``take(progress)``, ``progress`` = share of the arrival window gone: at most
    ``ceil(max_samples * progress)`` retries by then, so a capped sample spreads over the window
    instead of being spent on its first refusals."""

    max_samples: int = 20
    probability: float = 0.25
    seed: int = 0
    taken: int = 0
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def wants(self, idx: int) -> bool:
        return random.Random(self.seed * 1_000_003 + idx).random() < self.probability

    def take(self, progress: float = 1.0) -> bool:
        quota = min(self.max_samples, math.ceil(self.max_samples * max(0.0, progress)))
        if self.taken >= quota:
            return False
        self.taken += 1
        return True


def make_session() -> aiohttp.ClientSession:
    conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None))


def parse_error(raw: bytes, headers: Any) -> str | None:
    try:
        err = json.loads(raw).get("error")
        code = err.get("code") if isinstance(err, dict) else None
        if code is not None:
            return str(code)
    except (ValueError, AttributeError):
        pass
    reason = headers.get("X-Narwhal-Reason")
    return str(reason) if reason else None


def _float_header(headers: Any, name: str) -> float | None:
    v = headers.get(name)
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


def _retry_after(headers: Any) -> float | None:
    """``retry-after-ms`` when sent (as the OpenAI SDKs read it), else ``Retry-After``."""
    ms = _float_header(headers, "retry-after-ms")
    return ms / 1000.0 if ms is not None else _float_header(headers, "Retry-After")


def _chunk_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    src = delta if isinstance(delta, dict) else choice
    return any(bool(src.get(k)) for k in ("content", "text", "reasoning_content", "reasoning", "tool_calls", "refusal",
                                          "function_call"))


async def _read_stream(resp: aiohttp.ClientResponse, r: RequestResult, t_send: float) -> None:
    last: float | None = None
    done = False
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        now = time.perf_counter()
        if payload == b"[DONE]":
            done = True
            break
        try:
            ev = json.loads(payload)
        except ValueError:
            r.error_code = "malformed_sse"
            continue
        if "error" in ev:
            err = ev["error"]
            r.error_code = str(err.get("code")) if isinstance(err, dict) else "stream_error"
            continue
        usage = ev.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            r.output_tokens = int(usage["completion_tokens"])
        choices = ev.get("choices") or []
        if choices and _chunk_text(choices[0]):
            if last is None:
                r.ttft = now - t_send
            else:
                r.itl.append(now - last)
            last = now
    r.e2e = time.perf_counter() - t_send
    if r.output_tokens == 0:
        r.output_tokens = len(r.itl) + (1 if r.ttft is not None else 0)
    r.ok = done and r.error_code is None and r.ttft is not None
    if not done and r.error_code is None:
        r.error_code = "truncated_stream"


def request_body(shape: Shape, spec: RequestSpec, extra: dict[str, Any] | None = None) -> bytes:
    """The JSON body :func:`send_one` sends: ``spec`` shaped by ``shape``, plus ``extra`` fields."""
    body = build_body(spec, shape.api, shape.model, shape.stream, include_usage=shape.include_usage)
    return json.dumps({**body, **(extra or {})}).encode()


async def send_one(session: aiohttp.ClientSession, ep: Endpoint, shape: Shape, spec: RequestSpec,
                   r: RequestResult, t0: float, extra: dict[str, Any] | None = None,
                   headers_extra: dict[str, str] | None = None) -> None:
    """Send ``spec`` to ``ep`` and fill ``r`` in place (so a cancelled request keeps what it had);
    ``extra``: more body fields (e.g. the simulator's ``sim``)."""
    body = request_body(shape, spec, extra)
    headers = {"Content-Type": "application/json", **dict(ep.headers), **dict(shape.extra_headers),
               **(headers_extra or {})}
    t_send = time.perf_counter()
    r.sent = t_send - t0
    try:
        async with session.post(ep.url_for(spec.idx, shape.api), data=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=shape.timeout_s)) as resp:
            r.status = resp.status
            r.predicted_ttft = _float_header(resp.headers, PREDICTED_TTFT_HEADER)
            if resp.status != 200:
                r.error_code = parse_error(await resp.read(), resp.headers)
                r.retry_after = _retry_after(resp.headers)
                r.e2e = time.perf_counter() - t_send
                return
            if shape.stream:
                await _read_stream(resp, r, t_send)
                return
            data = json.loads(await resp.read())
            r.e2e = r.ttft = time.perf_counter() - t_send
            usage = data.get("usage") or {}
            r.output_tokens = int(usage.get("completion_tokens") or 0)
            r.ok = bool(data.get("choices"))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        r.error_code = r.error_code or type(exc).__name__
        r.e2e = time.perf_counter() - t_send


def _new_result(ep: Endpoint, spec: RequestSpec, retry_of: int | None = None) -> RequestResult:
    return RequestResult(idx=spec.idx, target=ep.name, sent=spec.at, prompt_tokens=spec.prompt_tokens,
                         max_tokens=spec.output_tokens, retry_of=retry_of)


async def _drain(tasks: set[asyncio.Task[None]], deadline: float) -> None:
    """Wait for ``tasks`` (a set that may still grow: retries) until ``deadline``; cancel the rest."""
    while True:
        pending = {t for t in tasks if not t.done()}
        left = deadline - time.perf_counter()
        if not pending or left <= 0:
            break
        await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    pending = {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


def _mark_cut(results: list[RequestResult]) -> None:
    for r in results:
        if not r.ok and r.error_code is None and not r.refused:
            r.error_code = "cut"


async def run_open_loop(session: aiohttp.ClientSession, ep: Endpoint, shape: Shape, specs: list[RequestSpec],
                        *, drain_s: float, retry: RetryPolicy | None = None,
                        progress: Progress | None = None) -> list[RequestResult]:
    """Send each spec at its ``at`` offset; wait at most ``drain_s`` after the last send."""
    t0 = time.perf_counter()
    window = specs[-1].at if specs else 0.0
    deadline = t0 + window + drain_s
    results: list[RequestResult] = []
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def one(spec: RequestSpec, r: RequestResult, delay: float = 0.0) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        retrying = retry is not None and retry.wants(spec.idx)
        count = {RETRY_COUNT_HEADER: "0" if r.retry_of is None else "1"} if retrying else None
        await send_one(session, ep, shape, spec, r, t0, headers_extra=count)
        if progress is not None:
            progress.record(r)
        now = time.perf_counter()
        if (retry is not None and retrying and r.retry_of is None and r.refused and r.retry_after is not None
                and now + r.retry_after < deadline - 1.0
                and retry.take((now - t0) / window if window > 0 else 1.0)):
            rr = _new_result(ep, spec, retry_of=spec.idx)
            results.append(rr)
            spawn(one(spec, rr, r.retry_after))

    for spec in specs:
        delay = t0 + spec.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        r = _new_result(ep, spec)
        results.append(r)
        if progress is not None:
            progress.sent += 1
        spawn(one(spec, r))
    await _drain(tasks, deadline)
    _mark_cut(results)
    return results


async def run_closed_loop(session: aiohttp.ClientSession, ep: Endpoint, shape: Shape, specs: list[RequestSpec],
                          *, concurrency: int, duration_s: float, drain_s: float = 10.0,
                          progress: Progress | None = None,
                          on_start: Callable[[], None] | None = None) -> list[RequestResult]:
    """``concurrency`` clients, each sending its next spec when its last answer is complete, until
    ``duration_s`` passes or the specs run out."""
    t0 = time.perf_counter()
    stop_at = t0 + duration_s
    results: list[RequestResult] = []
    it = iter(specs)

    async def worker() -> None:
        for spec in it:
            if time.perf_counter() >= stop_at:
                return
            r = _new_result(ep, spec)
            results.append(r)
            if progress is not None:
                progress.sent += 1
            await send_one(session, ep, shape, spec, r, t0)
            if progress is not None:
                progress.record(r)

    if on_start is not None:
        on_start()
    tasks = {asyncio.get_running_loop().create_task(worker()) for _ in range(concurrency)}
    await _drain(tasks, stop_at + drain_s)
    _mark_cut(results)
    return results
