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
  ``narwhal.request`` (ingress, SERVER; continues a client's W3C ``traceparent`` and
  ``tracestate``: a request with more than one ``traceparent`` field starts a new trace, as the
  spec's test suite wants) with a child ``narwhal.admission`` (decision, wait, placement); in the
  relay ``narwhal.attempt`` per candidate route tried and, below it, ``narwhal.prefill`` /
  ``narwhal.decode`` per engine leg and ``narwhal.resume`` per mid-stream continuation (CLIENT
  spans: an outgoing request each, so service graphs draw the router → engine edge).  Each leg
  sends the engine a ``traceparent`` (and the client's ``tracestate``) of its own span (vLLM
  continues it when it traces).  The request's span context crosses the Ray hop as those two
  strings in the placed request.  The request span is failed (Error) for a 5xx and for an answer
  that failed or expired after its 200 (an error event in the stream).
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
from typing import TYPE_CHECKING, Any, Protocol

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
    from_env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if _PROVIDER_SET or not (cfg.otlp_endpoint or from_env):
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("observability.tracing: the OTLP exporter is not installed (pip install narwhal-serve[tracing])")
        return
    # the config's is a base URL or the traces URL; the environment's the exporter reads itself, as
    # OpenTelemetry defines them (OTEL_EXPORTER_OTLP_ENDPOINT a base URL it adds /v1/traces to)
    endpoint = cfg.otlp_endpoint
    traces = None if endpoint is None else endpoint if endpoint.endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
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

    def _parent(self, traceparent: str | None, tracestate: str | None) -> "Context | None":
        if traceparent is None or _PROPAGATOR is None:
            return None
        carrier = {"traceparent": traceparent} if tracestate is None else {"traceparent": traceparent, "tracestate": tracestate}
        return _PROPAGATOR.extract(carrier)

    def start(
        self, name: str, *, parent: "Span | str | None" = None, tracestate: str | None = None, server: bool = False,
        client: bool = False, attributes: Mapping[str, Any] | None = None, start_time: float | None = None
    ) -> "Span | None":
        """A span below ``parent`` (a span, or a ``traceparent`` with its ``tracestate``; None: a
        new trace); ``server``/``client``: its kind (an incoming / outgoing request), else internal;
        ``start_time``: when it began (wall-clock seconds; None: now)."""
        if self._tracer is None:
            return None
        if isinstance(parent, str) or parent is None:
            ctx = self._parent(parent, tracestate)
        else:
            ctx = _otel.set_span_in_context(parent)
        kind = SpanKind.SERVER if server else SpanKind.CLIENT if client else SpanKind.INTERNAL
        return self._tracer.start_span(name, context=ctx, kind=kind, attributes=_attrs(attributes or {}),
                                       start_time=None if start_time is None else int(start_time * 1e9))

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
    span = tracing.start(name, parent=parent, client=True, attributes={"narwhal.engine": engine})
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

    def trace_context(self) -> tuple[str | None, str | None]:
        """``traceparent`` and ``tracestate`` of the request's span (None each: no span, no state)."""
        out = self.obs.tracing.headers_of(self.span)
        return out.get("traceparent"), out.get("tracestate")

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
            "ttft_s": _round(stats.client_ttft_s) if stats else None,
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
        if self.span is not None:  # (the attributes only where there is a span: tracing on)
            # failed for a 5xx and for an answer that failed after its 200 (OpenTelemetry's HTTP
            # server spans: a 2xx stays unset unless there was another error)
            failed = outcome is not Outcome.COMPLETED and (status >= 500 or outcome in (Outcome.FAILED, Outcome.EXPIRED))
            end_span(
                self.span,
                reason if failed else None,
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


class HeaderFields(Protocol):
    """A request's header fields, each name's values in order (Starlette's ``Headers``)."""

    def getlist(self, key: str) -> list[str]: ...


class Observability:
    def __init__(self, cfg: ObservabilityConfig, clock: Any = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.tracing = Tracing(cfg)
        if cfg.request_log:
            _request_log_handler()

    def trail(self, request_id: str, route: str, arrived: float, headers: HeaderFields) -> RequestTrail:
        span = None
        if self.tracing.on:
            # W3C Trace Context: traceparent is one field (more than one: invalid, a new trace);
            # tracestate is a list, its fields joined
            parents, states = headers.getlist("traceparent"), headers.getlist("tracestate")
            span = self.tracing.start(
                "narwhal.request", parent=parents[0] if len(parents) == 1 else None,
                tracestate=",".join(states) if states else None, server=True,
                attributes={"narwhal.request_id": request_id, "http.route": route},
                start_time=arrived,  # (its receipt: HAProxy's stamp, else now)
            )
        return RequestTrail(self, request_id, route, arrived, span=span)
