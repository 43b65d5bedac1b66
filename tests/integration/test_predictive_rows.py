"""The seed's predictive rows on the main app (admission: predictive), budgets set per request with
X-TTFT-Target against the fitted model that /status exposes."""

from __future__ import annotations

import httpx

from tests.integration.conftest import Graph
from tests.integration.helpers import Held, balanced, chat_body, counter, status, wait_status

URL = "/v1/chat/completions"


async def test_prompt_alone_over_budget(graph: Graph) -> None:
    before = counter(await status(graph.url), "refused", "prompt_exceeds_ttft_budget")
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post(URL, json=chat_body("long " * 2000), headers={"X-TTFT-Target": "0.0001"})
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "prompt_exceeds_ttft_budget")
    assert "shorten the prompt or raise the target" in err["message"]
    assert "retry-after" not in r.headers
    assert counter(await status(graph.url), "refused", "prompt_exceeds_ttft_budget") == before + 1


async def test_projected_ttft_over_budget_with_honest_retry_after(graph: Graph) -> None:
    g = graph.url
    # load both first-token engines with large prompts that never finish prefill
    held = [Held(g + URL, chat_body("word " * 20000, sim={"fault": "hang"}), {"X-TTFT-Target": "60"})
            for _ in range(2)]
    snap = await wait_status(
        g, lambda s: sum(e["pending_prefill_tokens"] > 0 for e in s["engines"] if e["role"] != "decode") == 2,
        "both routes hold pending prefill work")
    prompt = "short"
    p_tokens = 3
    firsts = [e for e in snap["engines"] if e["role"] != "decode"]
    alone = max(e["ttft_model"]["a_s"] + e["ttft_model"]["b_s_per_token"] * p_tokens for e in firsts)
    projected = min(
        e["ttft_model"]["a_s"] + e["ttft_model"]["b_s_per_token"] * (e["pending_prefill_tokens"] + p_tokens)
        for e in firsts
    )
    assert alone < projected
    budget = (alone + projected) / 2
    before = counter(snap, "refused", "ttft_budget_exceeded")
    try:
        async with httpx.AsyncClient(base_url=g, timeout=30) as c:
            r = await c.post(URL, json=chat_body(prompt), headers={"X-TTFT-Target": f"{budget:.6f}"})
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("rate_limit_error", "ttft_budget_exceeded")
            assert r.headers["retry-after"] == str(max(1, round(projected - budget)))
            assert counter(await status(g), "refused", "ttft_budget_exceeded") == before + 1
            # the same request with a budget above the projection is admitted
            r = await c.post(URL, json=chat_body(prompt), headers={"X-TTFT-Target": f"{projected + 1:.3f}"})
            assert r.status_code == 200, r.text
    finally:
        for h in held:
            await h.cancel()
    await wait_status(g, balanced, "counters balance and permits are back")
    snap = await status(g)
    assert all(e["pending_prefill_tokens"] == 0 for e in snap["engines"])
