"""One attempt at one route, and what the relay writes: the per-attempt state (its meter of token
IDs and timing, the transcript a resume continues from, what a first token or a resume changed since
the last message), the usage watch, and the SSE and error events (``relay/pipeline.py`` drives them).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from narwhal_serve.assembly.tokens import CHAT_GENERATED, COMPLETION_GENERATED, check_token_ids
from narwhal_serve.assembly.usage import usage_chunk
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.engines.legs import LegCursor
from narwhal_serve.errors import BadEngineResponse, ErrorInfo, TerminalExpiry, Unavailable
from narwhal_serve.observability import Tracing
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import ParsedRequest, Route
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.engines.errors import FaultKind
from narwhal_serve.relay.messages import EngineFault, HealthEvent
from narwhal_serve.relay.resume import DivergedResume, Transcript

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class DeadlinePassed(Exception):
    """The request's deadline passed while waiting for the engine."""


class BreakerCut(EngineFailure):
    """The router cut an answer off an engine whose circuit breaker opened, to resume it elsewhere
    (:meth:`~narwhal_serve.relay.pipeline.Relay.cut_engine`): not a fault of its own."""


def faults_of(exc: EngineFailure | BadEngineResponse, route: RouteChoice) -> tuple[EngineFault, ...]:
    """What a failed attempt says about its engine's health (nothing, for a :class:`BreakerCut`:
    the breaker is open already)."""
    if isinstance(exc, DivergedResume):  # (a sampled continuation's other turn: no engine's fault)
        return ()
    if isinstance(exc, BadEngineResponse):  # bad token IDs and other unusable answers
        return (EngineFault(route.decode.name, "error", str(exc)),)
    if isinstance(exc, BreakerCut):
        return ()
    kind: FaultKind = "backpressure" if exc.backpressure else "timeout" if exc.timed_out else "error"
    return (EngineFault(exc.engine, kind, exc.message, exc.retry_after_s),)


def deadline_info() -> ErrorInfo:
    return TerminalExpiry("terminal expiry: the request deadline passed", code="deadline_expired").info()


class UsageWatch:
    """Whether a stream carried usage, and what a computed usage chunk needs if it did not."""

    __slots__ = ("seen", "prompt_tokens", "meta")

    def __init__(self, prompt_estimate: int) -> None:
        self.seen = False
        self.prompt_tokens = prompt_estimate
        self.meta: dict[str, Any] = {}

    def observe(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage") is not None and not chunk.get("choices"):
            # the stream's usage chunk (usage on every chunk, continuous_usage_stats, is not it:
            # the engine still ends with one; one rule with the gateway's ending, usage_sent)
            self.seen = True
        for k in ("id", "object", "created", "system_fingerprint"):
            if k in chunk:
                self.meta[k] = chunk[k]
        ids = chunk.get("prompt_token_ids")
        choices = chunk.get("choices") or ()
        if ids is None and choices and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
        if isinstance(ids, list):
            self.prompt_tokens = len(ids)

    def chunk(self, model: str, completion_tokens: int) -> dict[str, Any]:
        return usage_chunk({**self.meta, "model": model}, self.prompt_tokens, completion_tokens)


class Meter:
    """Counts validated output tokens and times them (TTFT, decode time)."""

    __slots__ = ("start", "first", "last", "tokens", "check_ids", "route", "usage_tokens", "received")

    def __init__(self, start: float, check_ids: bool, route: Route, received: float | None = None) -> None:
        self.start = start
        self.received = received  # when the request reached the router (PlacedRequest.received)
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.check_ids = check_ids
        self.route = route
        self.usage_tokens: int | None = None  # without IDs: the engine's own count, from its usage

    def observe(self, chunk: dict[str, Any], now: float) -> None:
        if self.check_ids:
            n = check_token_ids(chunk, self.route)
        else:
            n = content_events(chunk)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                c = usage.get("completion_tokens")
                if isinstance(c, int) and not isinstance(c, bool) and c >= 0:
                    self.usage_tokens = c
        if n:
            self.tokens += n
            if self.first is None:
                self.first = now
            self.last = now


_GENERATED = COMPLETION_GENERATED + CHAT_GENERATED  # (a legacy function_call's fragments included)


def content_events(chunk: dict[str, Any]) -> int:
    n = 0
    for ch in chunk.get("choices") or ():
        delta = ch.get("delta", ch)
        if isinstance(delta, dict) and any(delta.get(k) for k in _GENERATED):
            n += 1
    return n


def backpressure_refusal(retry_after_s: list[float | None], failures: list[str]) -> ErrorInfo:
    """Every route tried answered 429/503: the engines are busy, not broken.  The client gets the
    contract's retryable capacity answer (503 ``backend_unavailable``, counted ``rejected`` with reason
    ``engine_backpressure``) and a ``Retry-After`` from the engines' own: the soonest any of them
    said it would take work (1 s when none said)."""
    known = [s for s in retry_after_s if s is not None and s > 0]
    wait = max(1, math.ceil(min(known))) if known else 1
    return Unavailable("every engine tried is busy (it answered 429/503); retry after the Retry-After: "
                       + "; ".join(failures), retry_after=wait, reason="engine_backpressure").info()


class Attempt:
    """One try of one route: its meter, the engine it waits on, its first-token limit, and what a
    resume after its first token moved (sent to the ingress with the next message)."""

    __slots__ = ("route", "attempt", "meter", "first_limit", "wait_from", "cursor", "transcript", "excluded",
                 "resumes", "notes", "moved", "health", "resumed_from", "gaps", "prefills", "turnarounds",
                 "cut_at", "timer", "cut_by", "prompt_ids")

    def __init__(self, route: RouteChoice, attempt: int, meter: Meter, first_limit: float | None,
                 req: ParsedRequest, excluded: set[str]) -> None:
        self.route = route
        self.attempt = attempt
        self.meter = meter
        self.first_limit = first_limit
        self.wait_from: float | None = meter.start  # waiting for a first token since (None: not waiting)
        self.cursor = LegCursor(route)
        self.transcript = Transcript(req)
        self.excluded = excluded  # engines that failed this request
        self.resumes = 0
        self.notes: list[tuple[str, str]] = []  # (reason, outcome) of resumes, not yet sent
        self.moved: tuple[str, ...] = ()  # the route a resume moved the request to, not yet sent
        self.health: list[HealthEvent] = []  # first tokens, and mid-stream failures that were resumed, not yet sent
        self.resumed_from: list[str] = []
        self.gaps: list[float] = []  # last token before each cut → first token after it
        self.prefills: list[float] = []  # each continuation's request → its first token
        self.turnarounds: list[float] = []  # each failure noticed → its continuation's request
        self.cut_at = 0.0  # when the last failure was noticed
        self.timer: asyncio.Timeout | None = None  # the limit of the engine read under way
        self.cut_by: str | None = None  # why the router cuts this answer off its engine (a breaker opened)
        self.prompt_ids: tuple[int, ...] | None = None  # the prompt went to the engine as these IDs (not its text)

    def stats(self) -> RelayStats:
        """What this attempt did, for the scheduler's models and the request log."""
        meter = self.meter
        ttft = None if meter.first is None else meter.first - meter.start
        # (never under the attempt's own: another node's clock may be a little behind)
        since = None if meter.first is None or meter.received is None else max(ttft or 0.0, meter.first - meter.received)
        decode = 0.0 if meter.first is None or meter.last is None else meter.last - meter.first
        # output tokens: the IDs checked; else the engine's usage where it sent one (an event may
        # carry several tokens, and a reasoning model's hidden tokens are in no event), else events
        out = meter.tokens if meter.check_ids or meter.usage_tokens is None else meter.usage_tokens
        return RelayStats(self.route.kind, self.route.engines, ttft, out, decode, self.attempt,
                          tuple(self.resumed_from), tuple(self.gaps), tuple(self.prefills), tuple(self.turnarounds),
                          received_ttft_s=since)

    def checked(
        self, batch: list[dict[str, Any]], now: float,
        shape: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ) -> tuple[list[dict[str, Any]], BadEngineResponse | None]:
        """The batch's chunks as the client will get them (``shape``d; None drops one), each one's
        token IDs checked and counted, then noted, up to the first bad one; and that one's error.
        What came before a bad chunk still goes out, so that a resume continues after exactly
        what the client got."""
        good: list[dict[str, Any]] = []
        try:
            for chunk in batch:
                shaped = chunk if shape is None else shape(chunk)
                if shaped is not None:
                    self.meter.observe(shaped, now)  # raises BadEngineResponse on bad token IDs
                    self.transcript.observe(shaped)
                    good.append(shaped)
        except BadEngineResponse as exc:
            return good, exc
        return good, None

    def news(self) -> dict[str, Any]:
        """What a first token or a resume changed since the last message, as :class:`RelayMessage` fields."""
        out: dict[str, Any] = {}
        if self.notes:
            out["resumes"], self.notes = tuple(self.notes), []
        if self.moved:
            out["engines"], out["moved"], self.moved = self.moved, True, ()
        if self.health:
            out["health"], self.health = tuple(self.health), []
        return out


def attempt_span(tracing: Tracing | None, placed: PlacedRequest, route: RouteChoice, attempt: int) -> "Span | None":
    """The trace span of one attempt at a placed request (None without tracing)."""
    if tracing is None:
        return None
    return tracing.start("narwhal.attempt", parent=placed.traceparent, tracestate=placed.tracestate, attributes={
        "narwhal.request_id": placed.request_id, "narwhal.attempt": attempt,
        "narwhal.route_kind": route.kind, "narwhal.engines": route.engines,
    })


def cut_reason(exc: Exception) -> str:
    """What cut a stream, for narwhal_resumes_total{reason}."""
    if isinstance(exc, BadEngineResponse):
        return "bad_response"
    if isinstance(exc, BreakerCut):
        return "breaker_open"
    if isinstance(exc, EngineFailure):
        if exc.timed_out:
            return "stall"
        return "engine_error" if exc.status is not None else "reset"
    return "engine_error"
