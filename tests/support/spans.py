"""Finished spans in memory, for tests of the router's tracing: one exporter per test process, added
once to the SDK provider (the one already set, if another test set one)."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EXPORTER = InMemorySpanExporter()
_INSTALLED: list[bool] = []


def install_span_exporter() -> InMemorySpanExporter:
    if not _INSTALLED:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        _INSTALLED.append(True)
    return EXPORTER
