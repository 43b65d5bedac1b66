"""GET /metrics: Prometheus text with the names docs/operations.md, "Metrics" lists, global counters."""

from __future__ import annotations

import httpx

from tests.integration.conftest import MODEL, Graph


async def test_metrics_names_and_movement(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        await c.post("/v1/completions", json={"model": MODEL, "prompt": "m", "max_tokens": 2})
        await c.post("/v1/completions", json={"model": "other", "prompt": "m"})
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert values["narwhal_offered_total"] >= 2 and values["narwhal_completed_total"] >= 1
    assert values['narwhal_invalid_requests_total{reason="model_not_found"}'] >= 1
    for name in ("narwhal_ttft_seconds", "narwhal_tpot_seconds", "narwhal_admission_wait_seconds",
                 "narwhal_ttft_prediction_error_seconds"):
        assert f"# TYPE {name} histogram" in text and values[f"{name}_count"] >= 0
    assert values["narwhal_ttft_seconds_count"] >= 1
    for name in ("narwhal_unsized_offered_total", "narwhal_retained_requests", "narwhal_queued_requests",
                 'narwhal_inflight_requests{phase="prefill"}', 'narwhal_inflight_requests{phase="decode"}'):
        assert name in values
    assert any(k.startswith("narwhal_engine_eligible{") for k in values)
    assert "# TYPE narwhal_rejected_total counter" in text and "# TYPE narwhal_refused_total counter" in text
