"""What the scheduler hands the assembler: a placed request and its ordered candidate routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from narwhal_serve.config import EngineConfig
from narwhal_serve.protocol.requests import ParsedRequest


@dataclass(frozen=True)
class RouteChoice:
    """One way to serve a request: a single engine, or a prefill engine and a decode engine."""

    kind: Literal["single", "pd"]
    decode: EngineConfig  # the engine whose stream reaches the client (the unified engine for "single")
    prefill: EngineConfig | None = None

    @property
    def engines(self) -> tuple[str, ...]:
        return (self.prefill.name, self.decode.name) if self.prefill else (self.decode.name,)


@dataclass(frozen=True)
class PlacedRequest:
    request_id: str
    model: str
    request: ParsedRequest
    candidates: tuple[RouteChoice, ...]
    deadline: float  # wall-clock seconds (time.time()), shared across processes
    traceparent: str | None = None  # W3C trace context of the ingress's request span (tracing on)
    # before headers, an attempt with no first token this long (seconds) moves to the next route
    first_token_s: float | None = None
    epoch: int = 0  # the router lease's fencing token it was admitted under (0: no lease backend)
    priority: int | None = None  # its class rank, sent to engines that schedule by priority (0 first)
    tracestate: str | None = None  # the request span's W3C tracestate (a client's, carried on)
    # wall-clock seconds it reached the router (HAProxy's stamp, else the ingress handler's start): its
    # TTFT as reported is counted from there
    received: float | None = None
