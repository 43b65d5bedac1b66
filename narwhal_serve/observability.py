"""What an operator reads about one request: a JSON log line when it ends, and (optionally)
OpenTelemetry spans that follow it from the ingress into the engines.

* **Log line** — one per finished request, on the ``narwhal.requests`` logger, whatever the path:
  invalid, refused, admitted and completed, failed, cancelled.  Fields: ``request_id``, ``route``,
  ``stream``, ``outcome`` and ``reason`` (docs/contract.md, "Admission"), ``status``, ``engines``, ``ttft_s``,
  ``output_tokens``, ``attempts``, ``prompt_tokens`` (with ``prompt_sizing``: ``tokenizer``,
  ``client_ids`` or ``estimate``), ``admission`` (``lease`` | ``scheduler``),
  ``admission_wait_s``, ``predicted_ttft_s``, ``duration_s``, ``trace_id``.  Never prompt or output
  text unless ``observability.log_prompt_text`` is set.
* **Spans** (``observability.tracing``; the ``opentelemetry`` packages are an optional dependency):
  ``narwhal.request`` (ingress, SERVER; continues a client's W3C ``traceparent``) with a child
  ``narwhal.admission`` (decision, wait, placement); in the assembler ``narwhal.attempt`` per
  candidate route tried and, below it, ``narwhal.prefill`` / ``narwhal.decode`` per engine leg.
  Each leg sends the engine a ``traceparent`` of its own span (vLLM continues it when it traces).
  The request's span context crosses the Ray hop as a ``traceparent`` string in the placed request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.config import ObservabilityConfig
from narwhal_serve.protocol.stats import RelayStats

REQUEST_LOG = logging.getLogger("narwhal.requests")
log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

try:  # optional: `pip install narwhal-serve[tracing]`
    from opentelemetry import trace as _otel
    from opentelemetry.trace import SpanKind, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _PROPAGATOR: TraceContextTextMapPropagator | None = TraceContextTextMapPropagator()
except ImportError:  # pragma: no cover - exercised only where the packages are absent
    _PROPAGATOR = None


_PROVIDER_SET = False


def _install_exporter(cfg: ObservabilityConfig) -> None:
    """An OTLP/HTTP exporter when an endpoint is configured (in the config or OpenTelemetry's own
    ``OTEL_EXPORTER_OTLP_ENDPOINT``); otherwise whatever provider the process already set up
    (a test's in-memory exporter, an operator's own SDK configuration)."""
    global _PROVIDER_SET
    endpoint = cfg.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if _PROVIDER_SET or not endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("observability.tracing: the OTLP exporter is not installed (pip install narwhal-serve[tracing])")
        return
    traces = endpoint if cfg.otlp_endpoint is None or endpoint.endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces)))
    _otel.set_tracer_provider(provider)
    _PROVIDER_SET = True


class Tracing:
    """Spans when tracing is on and OpenTelemetry is importable; every method is inert otherwise."""

    def __init__(self, cfg: ObservabilityConfig) -> None:
        self.on = cfg.tracing and _PROPAGATOR is not None
        if cfg.tracing and _PROPAGATOR is None:
            log.warning("observability.tracing is on but opentelemetry is not installed: no spans")
        self._tracer: "Tracer | None" = None
        if self.on:
            _install_exporter(cfg)
            self._tracer = _otel.get_tracer("narwhal")

    def _parent(self, traceparent: str | None) -> "Context | None":
        if traceparent is None or _PROPAGATOR is None:
            return None
        return _PROPAGATOR.extract({"traceparent": traceparent})

    def start(
        self, name: str, *, parent: "Span | str | None" = None, server: bool = False, attributes: Mapping[str, Any] | None = None
    ) -> "Span | None":
        if self._tracer is None:
            return None
        if isinstance(parent, str) or parent is None:
            ctx = self._parent(parent)
        else:
            ctx = _otel.set_span_in_context(parent)
        kind = SpanKind.SERVER if server else SpanKind.INTERNAL
        return self._tracer.start_span(name, context=ctx, kind=kind, attributes=_attrs(attributes or {}))

    def headers_of(self, span: "Span | None") -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span``, for an engine leg's request."""
        if span is None or _PROPAGATOR is None:
            return {}
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=_otel.set_span_in_context(span))
        return out


def _attrs(values: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry attribute values: no None, sequences as tuples of str."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if v is None:
            continue
        out[k] = tuple(str(x) for x in v) if isinstance(v, (list, tuple)) else v
    return out


def end_span(span: "Span | None", error: str | None = None, **attributes: Any) -> None:
    if span is None:
        return
    span.set_attributes(_attrs(attributes))
    if error:
        span.set_status(StatusCode.ERROR, error)
    span.end()


@contextlib.contextmanager
def leg_span(
    tracing: "Tracing | None", parent: "Span | None", name: str, engine: str, headers: dict[str, str]
) -> Iterator[dict[str, str]]:
    """An engine leg's span (no-op without tracing): yields the leg's headers, with a
    ``traceparent`` naming the leg's span; an exception out of the leg marks it failed."""
    if tracing is None or not tracing.on:
        yield headers
        return
    span = tracing.start(name, parent=parent, attributes={"narwhal.engine": engine})
    error = None
    try:
        yield {**headers, **tracing.headers_of(span)}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        end_span(span, error)


def trace_id_of(span: "Span | None") -> str | None:
    if span is None:
        return None
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


@dataclass
class RequestTrail:
    """One request at the ingress, from arrival to its terminal class: ended exactly once."""

    obs: "Observability"
    request_id: str
    route: str
    arrived: float  # wall clock
    stream: bool | None = None
    prompt_tokens: int | None = None
    prompt_sizing: str | None = None  # tokenizer | client_ids | estimate
    admission: str | None = None  # "lease" | "scheduler"
    admission_wait_s: float | None = None
    predicted_ttft_s: float | None = None
    prompt_text: str | None = None
    tenant: str | None = None  # its tenant's label (None: no tenants configured, or not identified)
    priority: str | None = None  # its priority class
    span: "Span | None" = None
    ended: bool = False
    _admission_span: "Span | None" = field(default=None, repr=False)

    def traceparent(self) -> str | None:
        return self.obs.tracing.headers_of(self.span).get("traceparent")

    def parsed(self, stream: bool, prompt_tokens: int, prompt_text: Callable[[], str | None],
               sizing: str | None = None) -> None:
        """``prompt_text``: the prompt as sent, made only when the operator logs it (a 512 KiB
        prompt's JSON costs milliseconds)."""
        self.stream, self.prompt_tokens, self.prompt_sizing = stream, prompt_tokens, sizing
        if self.obs.cfg.log_prompt_text:
            self.prompt_text = prompt_text()
        self._admission_span = self.obs.tracing.start("narwhal.admission", parent=self.span)

    def admitted(self, by: str, wait_s: float, predicted_ttft_s: float | None, engines: tuple[str, ...]) -> None:
        self.admission, self.admission_wait_s, self.predicted_ttft_s = by, wait_s, predicted_ttft_s
        end_span(
            self._admission_span, None, **{
                "narwhal.decision": "admitted", "narwhal.admission": by, "narwhal.admission_wait_s": wait_s,
                "narwhal.predicted_ttft_s": predicted_ttft_s, "narwhal.placement": engines,
            }
        )
        self._admission_span = None

    def end(self, outcome: Outcome, reason: str, status: int, stats: RelayStats | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if self._admission_span is not None:  # refused, or the client left, before a decision
            end_span(self._admission_span, None, **{"narwhal.decision": outcome.value, "narwhal.reason": reason})
        duration = max(0.0, self.obs.clock() - self.arrived)
        fields: dict[str, Any] = {
            "event": "request",
            "request_id": self.request_id,
            "route": self.route,
            "stream": self.stream,
            "outcome": outcome.value,
            "reason": reason,
            "status": status,
            "engines": list(stats.engines) if stats else [],
            "resumed_from": list(stats.resumed_from) if stats else [],
            "ttft_s": _round(stats.ttft_s) if stats else None,
            "output_tokens": stats.output_tokens if stats else 0,
            "attempts": stats.attempts if stats else 0,
            "prompt_tokens": self.prompt_tokens,
            "prompt_sizing": self.prompt_sizing,
            "tenant": self.tenant,
            "priority": self.priority,
            "admission": self.admission,
            "admission_wait_s": _round(self.admission_wait_s),
            "predicted_ttft_s": _round(self.predicted_ttft_s),
            "duration_s": _round(duration),
            "trace_id": trace_id_of(self.span),
        }
        if self.prompt_text is not None:
            fields["prompt"] = self.prompt_text
        end_span(
            self.span,
            reason if outcome is not Outcome.COMPLETED and status >= 500 else None,
            **{f"narwhal.{k}": v for k, v in fields.items() if k not in ("event", "request_id", "trace_id", "prompt")},
        )
        if self.obs.cfg.request_log and REQUEST_LOG.isEnabledFor(logging.INFO):
            REQUEST_LOG.info(json.dumps(fields, separators=(",", ":")))


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def _request_log_handler() -> None:
    """JSON lines on the process's standard output (under Ray: the replica's ``worker-*.out``
    log), unless the operator has already given the logger a handler of their own.  The original
    stream, not ``sys.stdout``: Ray Serve replaces that with a stream that turns every line into a
    log record of its own, walking the caller's stack for each (the largest single cost of a
    request's log line, ``narwhal-bench profile``)."""
    if REQUEST_LOG.level == logging.NOTSET:
        REQUEST_LOG.setLevel(logging.INFO)
    if REQUEST_LOG.handlers:
        return
    handler = logging.StreamHandler(sys.__stdout__ if sys.__stdout__ is not None else sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    REQUEST_LOG.addHandler(handler)
    REQUEST_LOG.propagate = False


class Observability:
    def __init__(self, cfg: ObservabilityConfig, clock: Any = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.tracing = Tracing(cfg)
        if cfg.request_log:
            _request_log_handler()

    def trail(self, request_id: str, route: str, arrived: float, headers: Mapping[str, str]) -> RequestTrail:
        span = None
        if self.tracing.on:
            span = self.tracing.start(
                "narwhal.request", parent=headers.get("traceparent"), server=True,
                attributes={"narwhal.request_id": request_id, "http.route": route},
            )
        return RequestTrail(self, request_id, route, arrived, span=span)
