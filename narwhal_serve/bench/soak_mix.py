"""``narwhal-bench soak``'s mix (:mod:`.soak`): its arguments, the kinds of request it sends — normal,
with an injected engine fault, a client that leaves mid-stream or before headers, a malformed or
truncated body — and how each is sent and read."""


from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from narwhal_serve.bench.client import Endpoint, Shape, parse_error, request_body, send_one
from narwhal_serve.bench.stats import RequestResult
from narwhal_serve.bench.workload import Api, LengthDist, RequestSpec, make_prompt
from narwhal_serve.config.sim import FAULT_NAMES, SCRIPT_NAMES

ENGINE_ONLY_FAULTS = frozenset({"unhealthy", "stale_metrics"})  # no effect as a per-request fault
REQUEST_FAULTS: tuple[str, ...] = tuple(sorted(FAULT_NAMES - ENGINE_ONLY_FAULTS))
HANG_FAULTS = frozenset({"hang", "hang_mid_stream"})
ENGINE_FAULTS: tuple[str, ...] = ("unhealthy", "error_500", "stale_metrics")
SCRIPTS: tuple[str, ...] = tuple(sorted(SCRIPT_NAMES))
MALFORMED_BODIES: tuple[bytes, ...] = (
    b"{not json",
    b"",
    b"[]",
    b'{"model": "narwhal-sim"}',
    b'{"model": "narwhal-sim", "messages": "hi", "prompt": 7}',
    b'{"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": -5}',
    b'{"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "n": "two"}',
)
"""Bodies Narwhal answers 400 on either route (a field the route does not read still rides along)."""

Kind = Literal["normal", "fault", "leave_mid_stream", "leave_before_headers", "malformed", "truncated_body"]


@dataclass(frozen=True)
class SoakArgs:
    minutes: float = 30.0
    concurrency: int = 16  # closed-loop clients
    think_s: float = 0.25  # mean pause (exponential) of a client between two requests
    sample_s: float = 10.0
    fault_rate: float = 0.10
    disconnect_rate: float = 0.05
    malformed_rate: float = 0.03
    engine_fault_every_s: float = 45.0  # 0: no engine-wide faults
    engine_fault_s: float = 10.0
    baseline_s: float | None = None  # None: 10 % of the load
    max_growth_pct: float = 10.0
    quiesce_timeout_s: float = 60.0
    prompt_median: float = 96.0
    output_median: float = 24.0
    model: str = "narwhal-sim"
    seed: int = 0
    ray_env: tuple[tuple[str, str], ...] = ()
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        rates = (self.fault_rate, self.disconnect_rate, self.malformed_rate)
        if min(rates) < 0 or sum(rates) > 1:
            raise ValueError("fault, disconnect and malformed rates must be >= 0 and sum to at most 1")
        if self.minutes <= 0 or self.concurrency < 1 or self.sample_s <= 0:
            raise ValueError("minutes and sample_s must be > 0, concurrency >= 1")

    @property
    def load_s(self) -> float:
        return self.minutes * 60.0

    @property
    def baseline_at_s(self) -> float:
        return self.load_s * 0.1 if self.baseline_s is None else self.baseline_s

    def kind_at(self, u: float) -> Kind:
        """The request kind for a uniform draw ``u`` in [0, 1)."""
        bounds: tuple[tuple[float, Kind], ...] = (
            (self.fault_rate, "fault"),
            (self.disconnect_rate / 2, "leave_mid_stream"),
            (self.disconnect_rate / 2, "leave_before_headers"),
            (self.malformed_rate * 0.8, "malformed"),
            (self.malformed_rate * 0.2, "truncated_body"),
        )
        edge = 0.0
        for share, kind in bounds:
            edge += share
            if u < edge:
                return kind
        return "normal"




@dataclass(frozen=True)
class Planned:
    """One request of the mix, decided before it is sent."""

    kind: Kind
    tag: str  # the tally's row: the kind, with the fault, script or body variant
    shape: Shape
    spec: RequestSpec
    extra: dict[str, Any] | None = None  # more body fields: the simulator's ``sim``
    leave_after: float = 0.0  # leave_mid_stream: data events read first; leave_before_headers: seconds
    raw_body: bytes | None = None  # malformed / truncated_body: sent as is (truncated: its first half)


PROMPT_SIGMA, OUTPUT_SIGMA = 1.0, 0.8


def plan_request(rng: np.random.Generator, a: SoakArgs, idx: int) -> Planned:
    """Draw one request of the mix (pure: the same generator state gives the same request)."""
    kind = a.kind_at(float(rng.random()))
    api: Api = "chat" if rng.random() < 0.6 else "completions"
    stream = bool(rng.random() < 0.7)
    n_prompt = LengthDist(a.prompt_median, PROMPT_SIGMA, 4, 2048).sample(rng, 1)[0]
    n_out = LengthDist(a.output_median, OUTPUT_SIGMA, 1, 256).sample(rng, 1)[0]
    headers: tuple[tuple[str, str], ...] = ()
    extra: dict[str, Any] | None = None
    tag: str = kind
    leave_after = 0.0
    raw: bytes | None = None
    if kind == "normal" and api == "chat" and rng.random() < 0.15:
        script = SCRIPTS[int(rng.integers(len(SCRIPTS)))]
        extra, tag = {"sim": {"script": script}}, f"normal script={script}"
    elif kind == "fault":
        fault = REQUEST_FAULTS[int(rng.integers(len(REQUEST_FAULTS)))]
        extra, tag = {"sim": {"fault": fault, "fault_after": int(rng.integers(0, 5))}}, f"fault {fault}"
        if fault == "tool_call_no_id":
            api = "chat"  # a tool call is a chat output
        if fault in HANG_FAULTS:
            headers = (("X-Request-Timeout", f"{rng.uniform(2.0, 5.0):.1f}"),)
    elif kind == "leave_mid_stream":
        stream, n_out, leave_after = True, int(rng.integers(64, 257)), float(rng.integers(1, 6))
    elif kind == "leave_before_headers":
        stream, n_out, leave_after = False, int(rng.integers(128, 257)), round(float(rng.uniform(0.01, 0.2)), 3)
    elif kind == "malformed":
        variant = int(rng.integers(len(MALFORMED_BODIES)))
        raw, tag = MALFORMED_BODIES[variant], f"malformed body#{variant}"
    shape = Shape(api=api, model=a.model, stream=stream, timeout_s=60.0, extra_headers=headers,
                  include_usage=bool(rng.random() < 0.5))
    spec = RequestSpec(idx, 0.0, n_prompt, n_out, make_prompt(rng, n_prompt))
    if kind == "truncated_body":
        raw = request_body(shape, spec)
    return Planned(kind, tag, shape, spec, extra, leave_after, raw)


def outcome(r: RequestResult) -> str:
    """A request's client-side outcome: ``ok``, or the error code (or ``HTTP <status>``)."""
    if r.ok:
        return "ok"
    return r.error_code or f"HTTP {r.status}"


def status_key(r: RequestResult) -> str:
    """The status-code tally's key: the HTTP status, ``left`` for a client that left on purpose
    before an answer, ``none`` for no answer (connection error, timeout)."""
    if r.status:
        return str(r.status)
    return "left" if (r.error_code or "").startswith("left") else "none"


async def _leave_mid_stream(session: aiohttp.ClientSession, url: str, p: Planned, r: RequestResult) -> None:
    body = request_body(p.shape, p.spec, p.extra)
    async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                            timeout=aiohttp.ClientTimeout(total=p.shape.timeout_s)) as resp:
        r.status = resp.status
        if resp.status != 200:
            r.error_code = parse_error(await resp.read(), resp.headers)
            return
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data:"):
                seen += 1
                if seen >= p.leave_after:
                    resp.close()  # drops the connection: the client is gone
                    r.error_code = "left mid-stream"
                    return
        r.error_code = "ended before the client left"


async def _leave_before_headers(session: aiohttp.ClientSession, url: str, p: Planned, r: RequestResult) -> None:
    body = request_body(p.shape, p.spec, p.extra)

    async def call() -> None:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            r.status = resp.status
            await resp.read()
            r.error_code = "answered before the client left"

    try:
        await asyncio.wait_for(call(), p.leave_after)  # cancelled: aiohttp closes the connection
    except TimeoutError:
        r.error_code = "left after headers" if r.status else "left before headers"


async def _malformed(session: aiohttp.ClientSession, url: str, p: Planned, r: RequestResult) -> None:
    async with session.post(url, data=p.raw_body or b"", headers={"Content-Type": "application/json"},
                            timeout=aiohttp.ClientTimeout(total=p.shape.timeout_s)) as resp:
        raw = await resp.read()
        r.status = resp.status  # 400 expected: the tally shows its error code (invalid_request)
        r.error_code = ("ACCEPTED" if resp.status == 200
                        else parse_error(raw, resp.headers) or f"HTTP {resp.status}")


async def _truncated_body(url: str, p: Planned, r: RequestResult) -> None:
    """Announce the whole body, send half of it, hang up (what a client that dies mid-upload does)."""
    u = urlsplit(url)
    body = p.raw_body or b"{}"
    head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    _, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(head + body[: len(body) // 2])
        await writer.drain()
        await asyncio.sleep(0.05)
    finally:
        writer.close()
        await writer.wait_closed()
    r.error_code = "left mid-body"


async def execute(session: aiohttp.ClientSession, ep: Endpoint, p: Planned, r: RequestResult, t0: float) -> None:
    """Send one planned request and fill ``r`` (status, ok, error code)."""
    url = ep.url_for(p.spec.idx, p.shape.api)
    try:
        if p.kind in ("normal", "fault"):
            await send_one(session, ep, p.shape, p.spec, r, t0, p.extra)
        elif p.kind == "leave_mid_stream":
            await _leave_mid_stream(session, url, p, r)
        elif p.kind == "leave_before_headers":
            await _leave_before_headers(session, url, p, r)
        elif p.kind == "malformed":
            await _malformed(session, url, p, r)
        else:
            await _truncated_body(url, p, r)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        r.error_code = r.error_code or type(exc).__name__
