"""Operators' view of a request, through the whole router in-process (gateway, scheduler, relay,
simulated engines): one JSON log line per finished request on every path, no prompt text unless
asked, and OpenTelemetry spans from the ingress into the engines (the SDK's in-memory exporter)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.support.local_router import LocalRouter, start_local_router

CHAT = "/v1/chat/completions"
SECRET = "do-not-log-this-prompt-7f3a"
EXPORTER = InMemorySpanExporter()


def _install_provider() -> None:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def of(self, rid: str) -> list[dict[str, Any]]:
        out = [json.loads(x) for x in self.lines]
        return [x for x in out if x["request_id"] == rid]


@pytest.fixture
def lines() -> Iterator[Lines]:
    h = Lines()
    log = logging.getLogger("narwhal.requests")
    log.addHandler(h)
    try:
        yield h
    finally:
        log.removeHandler(h)


@pytest.fixture(scope="module")
async def pd() -> AsyncIterator[LocalRouter]:
    _install_provider()
    r = await start_local_router({
        "admission": {"mode": "predictive"},
        "observability": {"tracing": True},
        "sim": {"engines": [{"name": "p1", "role": "prefill"}, {"name": "d1", "role": "decode"}]},
    })
    yield r
    await r.stop()


def chat(stream: bool, content: str = SECRET, **kw: object) -> dict[str, object]:
    return {"model": "narwhal-sim", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": stream, **kw}


async def _post(router: LocalRouter, body: object, rid: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        if isinstance(body, bytes):
            return await c.post(CHAT, content=body, headers={"X-Request-Id": rid, "Content-Type": "application/json", **headers})
        return await c.post(CHAT, json=body, headers={"X-Request-Id": rid, **headers})


async def test_one_json_line_per_request_on_every_path(pd: LocalRouter, lines: Lines) -> None:
    r = await _post(pd, chat(True, stream_options={"include_usage": True}), "log-stream")
    assert r.status_code == 200 and "[DONE]" in r.text
    r = await _post(pd, chat(False), "log-plain")
    assert r.status_code == 200
    r = await _post(pd, b'{"model": "narwhal-sim", "messages": [', "log-invalid")
    assert r.status_code == 400
    r = await _post(pd, chat(False, content="word " * 2_000), "log-refused", **{"X-TTFT-Target": "0.001"})
    assert r.status_code == 429, r.text
    await pd.app_reporter.flush()
    for rid in ("log-stream", "log-plain", "log-invalid", "log-refused"):
        assert len(lines.of(rid)) == 1, (rid, lines.lines)
    stream, plain = lines.of("log-stream")[0], lines.of("log-plain")[0]
    for line in (stream, plain):
        assert line["outcome"] == "completed" and line["status"] == 200 and line["reason"] == ""
        assert line["engines"] == ["p1", "d1"] and line["attempts"] == 1
        assert line["output_tokens"] == 4 and line["ttft_s"] > 0 and line["duration_s"] >= line["ttft_s"]
        assert line["admission"] in ("lease", "scheduler") and line["admission_wait_s"] >= 0
        assert line["predicted_ttft_s"] is not None and line["prompt_tokens"] > 0
        assert line["route"] == CHAT and line["trace_id"] is not None
    assert stream["stream"] is True and plain["stream"] is False
    invalid = lines.of("log-invalid")[0]
    assert (invalid["outcome"], invalid["status"], invalid["reason"]) == ("invalid_requests", 400, "invalid_request")
    assert invalid["engines"] == [] and invalid["admission"] is None
    refused = lines.of("log-refused")[0]
    assert (refused["outcome"], refused["status"], refused["reason"]) == ("refused", 429, "prompt_exceeds_ttft_budget")
    assert all(SECRET not in x for x in lines.lines)  # no prompt text by default


async def test_prompt_text_only_when_the_operator_asks(lines: Lines) -> None:
    r = await start_local_router({
        "admission": {"mode": "open"},
        "observability": {"log_prompt_text": True},
        "sim": {"engines": [{"name": "u1", "role": "unified"}]},
    })
    try:
        assert (await _post(r, chat(False), "log-text")).status_code == 200
    finally:
        await r.stop()
    (line,) = lines.of("log-text")
    assert SECRET in line["prompt"] and line["trace_id"] is None  # tracing stays off by default


def _by_name(spans: list[ReadableSpan], trace_id: int) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        assert s.context is not None
        if s.context.trace_id == trace_id:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_spans_follow_a_request_into_the_engines(pd: LocalRouter, stream: bool) -> None:
    EXPORTER.clear()
    client_trace = 0x5B8AA5A2D2C872E8321CF37308D69DF2
    traceparent = f"00-{client_trace:032x}-051581bf3cb55c13-01"
    rid = f"trace-{stream}"
    r = await _post(pd, chat(stream), rid, traceparent=traceparent)
    assert r.status_code == 200
    spans = _by_name(list(EXPORTER.get_finished_spans()), client_trace)  # the client's trace, continued
    (req,) = spans["narwhal.request"]
    (adm,) = spans["narwhal.admission"]
    (att,) = spans["narwhal.attempt"]
    (pre,) = spans["narwhal.prefill"]
    (dec,) = spans["narwhal.decode"]
    assert req.kind is SpanKind.SERVER and req.parent is not None and req.parent.span_id == 0x051581BF3CB55C13
    assert req.attributes is not None and req.attributes["narwhal.request_id"] == rid
    assert req.attributes["narwhal.outcome"] == "completed" and req.attributes["narwhal.output_tokens"] == 4
    assert adm.parent is not None and req.context is not None and adm.parent.span_id == req.context.span_id
    assert adm.attributes is not None and adm.attributes["narwhal.decision"] == "admitted"
    assert adm.attributes["narwhal.placement"] == ("p1", "d1")
    assert att.parent is not None and att.parent.span_id == req.context.span_id
    assert att.attributes is not None and att.attributes["narwhal.attempt"] == 1
    for leg, engine in ((pre, "p1"), (dec, "d1")):
        assert leg.parent is not None and att.context is not None and leg.parent.span_id == att.context.span_id
        assert leg.attributes is not None and leg.attributes["narwhal.engine"] == engine
        # the engine got a traceparent naming this leg's span
        seen = [x for x in pd.sim(engine).engine.recent if x["request_id"] == rid]
        assert len(seen) == 1 and leg.context is not None
        assert seen[0]["traceparent"] == f"00-{client_trace:032x}-{leg.context.span_id:016x}-01"


async def test_a_failed_attempt_is_a_failed_span_and_the_next_route_serves(lines: Lines) -> None:
    _install_provider()
    EXPORTER.clear()
    r = await start_local_router({
        "admission": {"mode": "open"},
        "observability": {"tracing": True},
        "sim": {"engines": [{"name": "u1", "role": "unified"}, {"name": "u2", "role": "unified"}]},
    })
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            await c.post(r.sim("u1").url + "/sim/control", json={"faults": ["error_500"]})
        for i in range(4):  # whichever engine is ranked first, u1 fails whenever it is tried
            assert (await _post(r, chat(False), f"retry-{i}")).status_code == 200
    finally:
        await r.stop()
    attempts = [s for s in EXPORTER.get_finished_spans() if s.name == "narwhal.attempt"]
    failed = [s for s in attempts if not s.status.is_ok]
    assert failed and all(s.attributes is not None and s.attributes["narwhal.engines"] == ("u1",) for s in failed)
    retried = [x for x in (lines.of(f"retry-{i}")[0] for i in range(4)) if x["attempts"] == 2]
    assert retried and all(x["engines"] == ["u2"] for x in retried)


async def test_an_answer_that_fails_before_headers_logs_the_routes_it_tried(lines: Lines) -> None:
    """(Found by a hostile probe.) A request the engine refused was logged with no engine and no
    attempt, as if it had never been placed; so was one every route failed."""
    r = await start_local_router({
        "admission": {"mode": "open"},
        "sim": {"engines": [{"name": "u1", "role": "unified"}]},
    })
    try:
        refused = await _post(r, chat(False, content="hello", truncate_prompt_tokens=0), "log-engine-400")  # (keeps none)
        assert refused.status_code == 400 and "The engine rejected the request" in refused.text, refused.text
        async with httpx.AsyncClient(timeout=10) as c:
            await c.post(r.sim("u1").url + "/sim/control", json={"faults": ["error_500"]})
        failed = await _post(r, chat(False), "log-all-failed")
        assert failed.status_code >= 500, failed.text
        await r.app_reporter.flush()
    finally:
        await r.stop()
    line = lines.of("log-engine-400")[0]
    assert (line["outcome"], line["status"], line["engines"], line["attempts"]) == ("invalid_requests", 400, ["u1"], 1)
    line = lines.of("log-all-failed")[0]
    assert (line["status"], line["engines"], line["attempts"]) == (failed.status_code, [], 1)
    assert line["ttft_s"] is None and line["output_tokens"] == 0
