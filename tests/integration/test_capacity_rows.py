"""The contract's capacity rows on the tight app (open admission, prefill 1 / decode 2, queue 1,
retention 3, max_wait 5 s), created with the simulator's hang faults — no sleeps."""

from __future__ import annotations

import asyncio

import httpx

from tests.integration.conftest import Graph
from tests.integration.helpers import (
    AUTH,
    Held,
    balanced,
    chat_body,
    counter,
    status,
    wait_engine_idle,
    wait_ready,
    wait_status,
)

HANG = {"fault": "hang"}


def url(graph: Graph) -> str:
    return graph.tight_url + "/v1/chat/completions"


async def post(graph: Graph, body: dict, **headers: str) -> httpx.Response:  # type: ignore[type-arg]
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url(graph), json=body, headers={**AUTH, **headers})


def assert_refusal(r: httpx.Response, status_code: int, type_: str, code: str, retry_after: str | None) -> None:
    assert r.status_code == status_code, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == (type_, code)
    assert r.headers.get("retry-after") == retry_after
    assert r.headers["x-narwhal-reason"] in (code, err["message"]) or r.headers["x-narwhal-reason"]


async def test_queue_full_then_queued_request_completes_after_release(graph: Graph) -> None:
    g = graph.tight_url
    before = counter(await status(g), "rejected", "queue_full")
    a = Held(url(graph), chat_body(sim=HANG), AUTH)
    await wait_status(g, lambda s: s["gauges"]["prefill_inflight"] == 1, "A admitted")
    b = Held(url(graph), chat_body("queued"), AUTH)
    await wait_status(g, lambda s: s["gauges"]["queued"] == 1, "B queued")
    r = await post(graph, chat_body())
    assert_refusal(r, 429, "rate_limit_error", "queue_full", "1")
    assert counter(await status(g), "rejected", "queue_full") == before + 1
    await a.cancel()  # client disconnect: A's permits come back, B is granted
    rb = await b.finished()
    assert rb.status_code == 200
    await wait_status(g, balanced, "counters balance and permits are back")


async def test_retention_full(graph: Graph) -> None:
    g = graph.tight_url
    # the role chunk and the first token, then the engine stalls: A is decoding (prefill 0/1, decode 1/2)
    a = Held(url(graph), chat_body(stream=True, sim={"fault": "hang_mid_stream", "fault_after": 2}), AUTH)
    await asyncio.wait_for(a.first_chunk.wait(), 30)
    await wait_status(g, lambda s: s["gauges"]["prefill_inflight"] == 0 and s["gauges"]["decode_inflight"] == 1, "A decoding")
    b = Held(url(graph), chat_body(sim=HANG), AUTH)  # prefill 1/1, decode 2/2
    await wait_status(g, lambda s: s["gauges"]["prefill_inflight"] == 1, "B admitted")
    c = Held(url(graph), chat_body("third"), AUTH)  # queued: retention 3/3
    await wait_status(g, lambda s: s["gauges"]["retained"] == 3, "retention full")
    r = await post(graph, chat_body())
    assert_refusal(r, 429, "rate_limit_error", "retention_full", "1")
    for h in (a, b):
        await h.cancel()
    assert (await c.finished()).status_code == 200
    await wait_status(g, balanced, "counters balance and permits are back")
    await wait_engine_idle(graph.tight_sim_url)  # the hanging engine streams were closed too


async def test_admission_wait_expires(graph: Graph) -> None:
    g = graph.tight_url
    before = counter(await status(g), "expired", "admission_wait_expired")
    a = Held(url(graph), chat_body(sim=HANG), AUTH)
    await wait_status(g, lambda s: s["gauges"]["prefill_inflight"] == 1, "A admitted")
    r = await post(graph, chat_body())  # waits max_wait_s = 5 s in the queue
    assert_refusal(r, 504, "timeout_error", "admission_wait_expired", None)
    assert "terminal expiry" in r.json()["error"]["message"]
    assert counter(await status(g), "expired", "admission_wait_expired") == before + 1
    # the request deadline (X-Request-Timeout) shorter than max_wait wins
    r = await post(graph, chat_body(), **{"X-Request-Timeout": "0.3"})
    assert_refusal(r, 504, "timeout_error", "deadline_expired", None)
    await a.cancel()
    await wait_status(g, balanced, "counters balance and permits are back")


async def test_deadline_expires_before_headers_at_the_engine(graph: Graph) -> None:
    g = graph.tight_url
    before = counter(await status(g), "expired", "deadline_expired")
    # X-Stainless-Timeout is what the official openai client sends
    r = await post(graph, chat_body(sim=HANG), **{"X-Stainless-Timeout": "0.5"})
    assert_refusal(r, 504, "timeout_error", "deadline_expired", None)
    assert "terminal expiry" in r.json()["error"]["message"]
    snap = await wait_status(g, balanced, "counters balance and permits are back")
    assert counter(snap, "expired", "deadline_expired") == before + 1


async def test_backend_unavailable_when_no_engine_is_eligible(graph: Graph) -> None:
    g = graph.tight_url
    async with httpx.AsyncClient(timeout=10) as c:
        await c.post(graph.tight_sim_url + "/sim/control", json={"faults": ["unhealthy"]})
    try:
        body = await wait_ready(g, 503)
        assert body == {"ready": False, "reason": "no_eligible_engines"}
        # the ingress admits under a lease whose fleet view is up to one renewal older than /ready:
        # until it renews, a request may still be placed (and served: the engine only fails /health)
        for _ in range(40):
            r = await post(graph, chat_body())
            if r.status_code != 200:
                break
            await asyncio.sleep(0.05)
        assert_refusal(r, 503, "service_unavailable_error", "backend_unavailable", "1")
    finally:
        async with httpx.AsyncClient(timeout=10) as c:
            await c.post(graph.tight_sim_url + "/sim/control", json={"faults": []})
    await wait_ready(g, 200)
    assert (await post(graph, chat_body())).status_code == 200


async def test_open_mode_admits_regardless_of_ttft_budget(graph: Graph) -> None:
    r = await post(graph, chat_body("x" * 2000), **{"X-TTFT-Target": "0.000001"})
    assert r.status_code == 200, r.text
