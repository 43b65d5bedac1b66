"""What the router did for one finished request, as the relay measured it: read by the scheduler's
models, the tenants' tallies, the request log and the metrics (it crosses the Ray hop in a report)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RelayStats:
    route_kind: str
    engines: tuple[str, ...]
    ttft_s: float | None  # the answering attempt's request to the engine → its first token (the models learn it)
    output_tokens: int
    decode_s: float  # time from the first to the last generated token
    attempts: int
    resumed_from: tuple[str, ...] = ()  # engines that died mid-answer, the request resumed elsewhere
    resume_gap_s: tuple[float, ...] = ()  # per resume: last token before the cut → first token after
    resume_prefill_s: tuple[float, ...] = ()  # per resume: the continuation's request → its first token
    resume_turnaround_s: tuple[float, ...] = ()  # per resume: the failure noticed → the continuation's request
    # The stream was cut before its last message (the client left, read too slowly, the router
    # stopped): what the router saw up to the cut — the route that was answering and the output
    # tokens identified so far — with no timings (``ttft_s`` None, ``decode_s`` 0, ``attempts`` 0:
    # not known); or the answer failed before response headers (:meth:`before_headers`).  Counted
    # (request log, tenants' and classes' output tokens), never learned from.
    partial: bool = False
    # the request's receipt (HAProxy's stamp, else the ingress handler's start) → its first token: the
    # TTFT its client got as far as the router can see, its waits and earlier attempts included
    received_ttft_s: float | None = None

    @property
    def client_ttft_s(self) -> float | None:
        """The TTFT reported and judged against the budget (log, histogram, goodput)."""
        return self.ttft_s if self.received_ttft_s is None else self.received_ttft_s

    @classmethod
    def cut(cls, engines: tuple[str, ...], output_tokens: int) -> "RelayStats":
        return cls("", engines, None, output_tokens, 0.0, 0, partial=True)

    @classmethod
    def before_headers(cls, engines: tuple[str, ...], attempts: int) -> "RelayStats":
        """An answer that failed before response headers: the route that refused the request
        (``engines``; none when every route failed) and the routes tried (the request log)."""
        return cls("", engines, None, 0, 0.0, attempts, partial=True)
