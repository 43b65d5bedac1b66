"""What the assembler sends the ingress over the one streaming hop: one message type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from narwhal_serve.engines.errors import FaultKind
from narwhal_serve.errors import ErrorInfo
from narwhal_serve.protocol.stats import RelayStats


# What was cut, for narwhal_resumes_total{reason}
RESUME_REASONS = ("reset", "stall", "engine_error", "bad_response", "breaker_open")
# How it ended, for narwhal_resumes_total{outcome}: resumed (the continuation's first token came),
# finished (the cut came after the last token: the end is written by the router), failed (the
# continuation failed too), and why none was tried: not_exact, no_engine, limit (serving.max_resumes),
# deadline
RESUME_OUTCOMES = ("resumed", "finished", "failed", "not_exact", "no_engine", "limit", "deadline")



@dataclass(frozen=True)
class EngineFault:
    """One failed attempt, for the engine's passive health (the scheduler's breaker).

    ``kind``: ``error`` (HTTP error, broken or malformed stream, bad token IDs), ``timeout`` (silent
    past the idle or first-token limit) or ``backpressure`` (the engine's 429/503: busy, not broken).
    """

    engine: str
    kind: FaultKind
    why: str = ""
    retry_after_s: float | None = None


@dataclass(frozen=True)
class EngineWorked:
    """An attempt's good first token on these engines: a success for their breakers.  It travels in
    the same ordered list as the :class:`EngineFault` s, so the scheduler counts "failures in a row"
    in the order they happened (an answer's first token, then its mid-stream fault: one failure)."""

    engines: tuple[str, ...]


HealthEvent = EngineFault | EngineWorked


@dataclass(frozen=True)
class RelayMessage:
    """``data`` is what the client gets (SSE events, or the assembled JSON body).

    ``error`` set on a message with no data: the request failed before response headers, and
    ``error`` is the refusal to send.  ``error`` set on a message with data: the stream failed after
    headers and ``data`` already holds the error event and ``[DONE]``.  ``first_token`` marks the
    end of the prefill phase (``engines`` says which route served it); ``final`` the last message, with
    ``stats``.
    """

    data: bytes = b""
    error: ErrorInfo | None = None
    first_token: bool = False
    final: bool = False
    stats: RelayStats | None = None
    engines: tuple[str, ...] = ()  # with ``first_token``: the route that produced it
    health: tuple[HealthEvent, ...] = ()  # attempts that failed, and first tokens, since the last message (in order)
    tokens: int = 0  # identified output tokens so far (streams: decode correction at the scheduler)
    moved: bool = False  # with ``engines``: a resume moved the answer to that route (docs/contract.md, "Engine failures")
    resumes: tuple[tuple[str, str], ...] = ()  # (reason, outcome) of each cut since the last message
    # with the first token of a stream that asked for usage: its chunks' identity (id, object,
    # created, model) and its prompt tokens, for a usage chunk the router writes itself (a drain
    # ending the stream)
    usage_meta: tuple[dict[str, Any], int] | None = None
    usage_sent: bool = False  # the engine's usage chunk went out, in this message or an earlier one
