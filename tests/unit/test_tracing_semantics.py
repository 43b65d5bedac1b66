"""From a differential review of Narwhal's tracing and request-id propagation against the W3C Trace Context
spec, what vLLM 0.32 reads from a request (``traceparent`` and ``tracestate``), the OpenTelemetry SDK
/ exporter semantics and the HTTP semantic conventions.  In-process only: the gateway over
``httpx.ASGITransport``, the relay over ``httpx.MockTransport`` engines, the SDK's in-memory
exporter; no Ray, no servers.

Each test here failed before its fix, for the reason its docstring gives (the docstrings describe
the code as it was)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from starlette.datastructures import Headers

import narwhal_serve.observability as obsmod
from narwhal_serve.config import EngineConfig, NarwhalConfig, ObservabilityConfig
from narwhal_serve.gateway.app import GatewayApp, build_api
from narwhal_serve.observability import Observability, Tracing, leg_span
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.relay.pipeline import Relay
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.spans import install_span_exporter
from tests.support.sse import ReadsApart, chat_role, chat_token, completion_token, sse_bytes

EXPORTER = install_span_exporter()
_install_provider = install_span_exporter


@pytest.fixture(autouse=True)
def _provider() -> None:
    _install_provider()


CHAT = "/v1/chat/completions"
E1 = EngineConfig(name="e1", url="http://e1")
E2 = EngineConfig(name="e2", url="http://e2")
PROMPT = [7, 8, 9]


def _ids(n: int) -> tuple[str, str]:
    """A client trace id and span id of its own for each test (spans are told apart by trace)."""
    return f"{0x5B8AA5A2D2C872E8321CF37308D69D00 + n:032x}", f"{0x051581BF3CB55C00 + n:016x}"


def _spans(trace_hex: str, name: str | None = None) -> list[ReadableSpan]:
    tid = int(trace_hex, 16)
    return [s for s in EXPORTER.get_finished_spans()
            if s.context is not None and s.context.trace_id == tid and (name is None or s.name == name)]


# -- engines (httpx.MockTransport) ------------------------------------------------------------


WHOLE = sse_bytes(chat_role(PROMPT), chat_token("a", 1), chat_token("b", 2), chat_token("c", 3, "stop"))
FIRST_TWO = sse_bytes(chat_role(PROMPT), chat_token("a", 1), chat_token("b", 2), done=False)  # then the connection drops
CONTINUATION = sse_bytes(completion_token("c", 3), completion_token("d", 4), completion_token("e", 5, "length"))
_Parts = ReadsApart


class _Engines:
    """Records what each engine received; ``answer(host)`` is its response."""

    def __init__(self, answer: Callable[[str], httpx.Response]) -> None:
        self.answer = answer
        self.seen: list[tuple[str, httpx.Headers, dict[str, Any]]] = []

    def __call__(self, r: httpx.Request) -> httpx.Response:
        self.seen.append((r.url.host, r.headers, json.loads(r.content)))
        return self.answer(r.url.host)

    def headers_of(self, host: str) -> list[httpx.Headers]:
        return [h for name, h, _ in self.seen if name == host]


# -- the gateway in-process, over a stub scheduler and a real relay ------------------------------


class _Backend:
    """The gateway's Backend: admits every request to ``candidates``; a real Relay (tracing as
    configured) over MockTransport engines, as an ingress with ``deployment.relay: ingress``."""

    def __init__(self, cfg: NarwhalConfig, engines: _Engines, candidates: tuple[RouteChoice, ...]) -> None:
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
        self.relay_ = Relay.configured(self.client, cfg.serving, cfg.observability, coalesce_reads=False)
        self.candidates = candidates

    async def admit(self, req: AdmitRequest) -> AdmitResult:
        return AdmitResult(candidates=self.candidates)

    async def cancel(self, ticket_id: str) -> None:
        return None

    async def report(self, rep: Any) -> None:
        return None

    async def watch(self, lease_id: str) -> bool:
        return False

    async def snapshot(self) -> dict[str, Any]:
        return {}

    async def metrics_text(self) -> str:
        return ""

    async def admin(self, op: str, arg: Any) -> Any:
        return None

    def relay(self, placed: PlacedRequest) -> Any:
        return self.relay_.run(placed)

    @property
    def local_relay(self) -> Relay | None:
        return self.relay_


def _cfg() -> NarwhalConfig:
    return NarwhalConfig.model_validate({
        "admission": {"mode": "open", "ingress_leases": False},
        "observability": {"tracing": True, "request_log": False},
    })


async def _post(engines: _Engines, candidates: tuple[RouteChoice, ...], headers: dict[str, str],
                sizer: PromptSizer | None = None, **body: Any) -> httpx.Response:
    cfg = _cfg()
    backend = _Backend(cfg, engines, candidates)
    app: GatewayApp = build_api(cfg, backend, sizer=sizer or PromptSizer(None))  # type: ignore[arg-type]
    payload = {"model": cfg.model, "messages": [{"role": "user", "content": "q"}], "max_tokens": 5,
               "stream": True, **body}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=20) as c:
            return await c.post(CHAT, json=payload, headers=headers)
    finally:
        await app.state.reporter.stop()
        await backend.client.aclose()


# -- 1. tracestate ---------------------------------------------------------------------------------


async def test_a_clients_tracestate_reaches_the_engine_with_the_traceparent() -> None:
    """W3C Trace Context §3.3/§3.5: a participant that receives ``tracestate`` MUST send it on its
    outgoing requests (it MAY update its own entry), and vLLM 0.32 reads both headers
    (vllm/tracing/utils.py:12 TRACE_HEADERS = ["traceparent", "tracestate"]).  Narwhal extracts
    the client's context from ``traceparent`` alone (observability.py Tracing._parent /
    Observability.trail), and the Ray hop carries only a ``traceparent`` string
    (RequestTrail.traceparent -> PlacedRequest.traceparent): the client's tracestate is dropped."""
    t, s = _ids(1)
    tracestate = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    engines = _Engines(lambda host: httpx.Response(200, stream=_Parts(WHOLE)))
    r = await _post(engines, (RouteChoice("single", E1),),
                    {"traceparent": f"00-{t}-{s}-01", "tracestate": tracestate})
    assert r.status_code == 200 and "[DONE]" in r.text, r.text
    (sent,) = engines.headers_of("e1")
    assert sent["traceparent"].split("-")[1] == t  # the client's trace, continued (this part holds)
    assert sent.get("tracestate") == tracestate, f"tracestate sent to the engine: {sent.get('tracestate')!r}"


# -- 2. duplicated traceparent -------------------------------------------------------------------------


def test_two_different_traceparent_headers_restart_the_trace() -> None:
    """W3C trace-context test suite (test/test.py, test_traceparent_duplicated): a request with two
    ``traceparent`` header fields is invalid; the vendor restarts the trace (a new trace id,
    neither of the two).  Narwhal reads ``headers.get("traceparent")`` (observability.py
    Observability.trail): the first field wins, and an intermediary's copy appended after a
    client's is silently overridden by the client's (as body.py's ``header`` already refuses for
    Narwhal's own headers)."""
    obs = Observability(ObservabilityConfig(tracing=True, request_log=False))
    first, second = "1" * 32, "2" * 32
    headers = Headers(raw=[(b"traceparent", f"00-{first}-1234567890123456-01".encode()),
                           (b"traceparent", f"00-{second}-1234567890123456-01".encode())])
    trail = obs.trail("dup", CHAT, 0.0, headers)
    assert trail.span is not None
    got = f"{trail.span.get_span_context().trace_id:032x}"
    trail.span.end()
    assert got not in (first, second), f"continued trace {got} from one of two conflicting traceparents"


# -- 3. the resumed continuation leg -----------------------------------------------------------------


async def test_a_resumed_continuation_sends_the_engine_a_traceparent() -> None:
    """Each leg sends its engine a ``traceparent`` naming its span (docs/operations.md, "Logs and
    traces"), so vLLM's ``llm_request`` span nests under it.  A mid-stream resume opens a new engine
    request (relay/resuming.py ``_resume``: ``stream_chunks(..., headers)``) with the attempt's bare
    headers: no leg span and no ``traceparent``, so the continuation engine's span starts a trace of
    its own (vllm/tracing/otel.py:125 extract_trace_context(None) -> a root span)."""
    t, s = _ids(3)
    engines = _Engines(lambda host: httpx.Response(200, stream=_Parts(FIRST_TWO, broken=True)) if host == "e1"
                       else httpx.Response(200, stream=_Parts(CONTINUATION)))
    r = await _post(engines, (RouteChoice("single", E1), RouteChoice("single", E2)),
                    {"traceparent": f"00-{t}-{s}-01"}, return_token_ids=True, temperature=0)
    assert r.status_code == 200 and "[DONE]" in r.text and '"error"' not in r.text, r.text
    assert [h for h, _, _ in engines.seen] == ["e1", "e2"]  # resumed on e2 (this part holds)
    (first,) = engines.headers_of("e1")
    assert first["traceparent"].split("-")[1] == t
    (cont,) = engines.headers_of("e2")
    assert "traceparent" in cont, "the continuation leg reached e2 without a traceparent"
    assert cont["traceparent"].split("-")[1] == t


# -- 4. the request span's status on a failure after headers -----------------------------------------


async def test_a_stream_that_ends_in_an_error_event_marks_the_request_span_failed() -> None:
    """OpenTelemetry HTTP semantic conventions (server spans): status stays unset for a 2xx answer
    *unless there was another error*, then it MUST be Error.  A stream cut after its first token
    that cannot be resumed ends with an error event (outcome ``failed``) behind a 200; Narwhal marks
    the request span failed only for ``status >= 500`` (observability.py RequestTrail.end), so the
    trace's root looks healthy while its ``narwhal.attempt`` child is Error."""
    t, s = _ids(4)
    engines = _Engines(lambda host: httpx.Response(200, stream=_Parts(FIRST_TWO, broken=True)))
    r = await _post(engines, (RouteChoice("single", E1),), {"traceparent": f"00-{t}-{s}-01"},
                    return_token_ids=True)
    assert r.status_code == 200 and '"error"' in r.text and "[DONE]" in r.text, r.text  # the failure, in-stream
    (attempt,) = _spans(t, "narwhal.attempt")
    assert attempt.status.status_code is StatusCode.ERROR  # the child knows (this part holds)
    (req,) = _spans(t, "narwhal.request")
    assert req.attributes is not None and req.attributes["narwhal.outcome"] == "failed"
    assert req.status.status_code is StatusCode.ERROR, f"request span status {req.status.status_code}"


# -- 5. a request span left open by an unexpected exception -------------------------------------------


class _FaultySizer(PromptSizer):
    """A fault in the router's own code before admission (a bug): not a NarwhalError."""

    async def size(self, parsed: Any) -> Any:
        raise RuntimeError("a bug")


async def test_an_unexpected_fault_still_ends_the_request_span() -> None:
    """A request span is ended "exactly once on every path" (RequestTrail).  ``handle`` ends the
    trail for NarwhalError, BodyIncomplete and cancellation only; any other exception escapes to
    gateway/app.py ``_call_fast``, which answers 500 — with the ``narwhal.request`` span (and the
    request's log line) never ended, so the exported trace has no root."""
    t, s = _ids(5)
    engines = _Engines(lambda host: httpx.Response(200, stream=_Parts(WHOLE)))
    r = await _post(engines, (RouteChoice("single", E1),), {"traceparent": f"00-{t}-{s}-01"},
                    sizer=_FaultySizer(None))
    assert r.status_code == 500, r.text
    ended = _spans(t, "narwhal.request")
    assert len(ended) == 1, f"narwhal.request spans ended: {len(ended)}"
    assert ended[0].status.status_code is StatusCode.ERROR


# -- 6. span kind of an engine leg ----------------------------------------------------------------------


def test_an_engine_leg_span_is_a_client_span() -> None:
    """An engine leg is an outgoing HTTP request: OpenTelemetry's HTTP conventions make its span kind
    CLIENT, and the collector's servicegraph connector (Tempo's service graph) builds an edge only
    from a CLIENT span to the SERVER span below it — vLLM's ``llm_request`` is SERVER
    (v1/engine/output_processor.py do_tracing, kind=SpanKind.SERVER).  Narwhal's leg spans are
    INTERNAL (observability.py Tracing.start / leg_span): no narwhal -> vllm edge."""
    tracing = Tracing(ObservabilityConfig(tracing=True))
    with leg_span(tracing, None, "narwhal.decode", "e1", {}) as h:
        span_id = int(h["traceparent"].split("-")[2], 16)
    (leg,) = [x for x in EXPORTER.get_finished_spans() if x.context is not None and x.context.span_id == span_id]
    assert leg.kind is SpanKind.CLIENT, f"leg span kind {leg.kind}"


# -- 7. the OTLP endpoint taken from the environment --------------------------------------------------


def test_otel_exporter_otlp_endpoint_gets_the_traces_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenTelemetry's exporter configuration: ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL; an
    OTLP/HTTP exporter sends traces to it + ``/v1/traces`` (opentelemetry-exporter-otlp-proto-http
    _common._resolve_endpoint).  ``OTLPSpanExporter(endpoint=...)`` takes a full signal URL
    verbatim, and observability.py ``_install_exporter`` passes the environment's base URL as that
    (``traces = endpoint if cfg.otlp_endpoint is None ...``): spans POST to the collector's root,
    which answers 404, and every span is lost."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter as te

    seen: dict[str, Any] = {}
    real = te.OTLPSpanExporter

    class Capture(real):  # type: ignore[misc,valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            seen["endpoint"] = self._endpoint

    monkeypatch.setattr(te, "OTLPSpanExporter", Capture)
    monkeypatch.setattr(obsmod, "_PROVIDER_SET", False)
    monkeypatch.setattr(obsmod._otel, "set_tracer_provider", lambda p: seen.setdefault("provider", p))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    try:
        obsmod._install_exporter(ObservabilityConfig(tracing=True))
    finally:
        if "provider" in seen:
            seen["provider"].shutdown()
    assert seen.get("endpoint") == "http://collector:4318/v1/traces", f"spans exported to {seen.get('endpoint')!r}"
