"""Every request bounded in time: the deadline holds for the whole request, after response
headers too — a stalled stream ends with an error event and [DONE], never silently."""

from __future__ import annotations

import json
import time

import httpx

from tests.integration.conftest import Graph
from tests.integration.helpers import AUTH, balanced, chat_body, counter, status, wait_engine_idle, wait_status


async def test_a_stalled_stream_ends_at_its_deadline_with_an_error_event(graph: Graph) -> None:
    g = graph.tight_url
    before = counter(await status(g), "expired", "deadline_expired")
    body = chat_body(stream=True, sim={"fault": "hang_mid_stream", "fault_after": 2})
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(g + "/v1/chat/completions", json=body, headers={**AUTH, "X-Request-Timeout": "1.5"})
    took = time.monotonic() - t0
    assert r.status_code == 200  # headers went out with the first token
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "deadline_expired" and err["type"] == "timeout_error"
    assert took < 10, f"the stream ran {took:.1f} s past a 1.5 s deadline"
    snap = await wait_status(g, balanced, "counters balance and permits are back")
    assert counter(snap, "expired", "deadline_expired") == before + 1
    await wait_engine_idle(graph.tight_sim_url)  # the engine request was aborted
