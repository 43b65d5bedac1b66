"""Standby / fenced / maintenance / monitoring-degraded: 503 router_unavailable and /ready's reason."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import ADMIN, Graph
from tests.integration.helpers import chat_body, counter, status, wait_ready


async def _refused_with(graph: Graph, reason: str) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        before = counter(await status(graph.url), "rejected", "router_unavailable")
        r = await c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("service_unavailable_error", "router_unavailable")
        assert reason in err["message"]
        assert r.headers["retry-after"] == "1" and r.headers["x-narwhal-reason"] == reason
        ready = await c.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"ready": False, "reason": reason}
        assert counter(await status(graph.url), "rejected", "router_unavailable") == before + 1


@pytest.mark.parametrize("mode", ["standby", "fenced", "monitoring_degraded"])
async def test_router_mode_refusals(graph: Graph, mode: str) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        assert (await c.post("/admin/state", json={"mode": mode})).status_code == 401  # admin token needed
        assert (await c.post("/admin/state", json={"mode": mode}, headers=ADMIN)).status_code == 200
        try:
            await _refused_with(graph, mode)
        finally:
            await c.post("/admin/state", json={"mode": "active"}, headers=ADMIN)
    await wait_ready(graph.url, 200)


async def test_whole_wave_maintenance(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30, headers=ADMIN) as c:
        assert (await c.post("/admin/maintenance", json={"waves": ["a"]})).status_code == 200
        try:
            await _refused_with(graph, "maintenance")
        finally:
            assert (await c.request("DELETE", "/admin/maintenance", json={"waves": ["a"]})).status_code == 200
    await wait_ready(graph.url, 200)
