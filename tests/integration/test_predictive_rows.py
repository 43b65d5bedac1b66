"""The contract's predictive rows on the main app (admission: predictive), budgets set per request with
X-TTFT-Target against the fitted model that /status exposes."""

from __future__ import annotations

import httpx

from narwhal_serve.prediction.ttft import with_margin
from tests.integration.conftest import Graph
from tests.integration.helpers import Held, balanced, chat_body, counter, status, wait_status, without_engine

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
    """With the unified engine deregistered, one P/D route remains: load its prefill engine with a
    long prompt that never finishes, then ask for a budget between 'prompt alone' and 'projected'."""
    async with without_engine(graph.url, graph.unified_engine()):
        await _over_budget(graph.url)


async def _over_budget(g: str) -> None:
    held = Held(g + URL, chat_body("word " * 2000, sim={"fault": "hang"}), {"X-TTFT-Target": "60"})

    def loaded(s: dict) -> bool:  # type: ignore[type-arg]
        if held.failed() is not None or (held.result is not None and held.result.status_code != 200):
            raise AssertionError(f"the held request ended early: {held.failed()!r} {held.result}")
        return any(e["role"] == "prefill" and e["pending_prefill_tokens"] > 0 for e in s["engines"])

    snap = await wait_status(g, loaded, "the prefill engine holds pending prefill work")
    prefill = next(e for e in snap["engines"] if e["role"] == "prefill")
    model = prefill["ttft_model"]
    a, b, pending = model["a_s"], model["b_s_per_token"], prefill["pending_prefill_tokens"]
    p_tokens = 3  # "short" as the router sizes it: chars/4 over the message plus its role overhead
    # as admission judges them: with the engine's error margin (learned from earlier requests of the
    # suite: ignoring it made the budget fall under the prompt alone as judged, a flaky refusal)
    alone = with_margin(a + b * p_tokens, model["idle_margin"])  # (the prompt alone: the idle engine's margin)
    projected = with_margin(a + b * (pending + p_tokens) + model["c_s_per_request_ahead"], model["margin"])
    assert projected - alone > 0.02, (alone, projected, model)  # a budget fits between the two
    budget = (alone + projected) / 2
    before = counter(snap, "refused", "ttft_budget_exceeded")
    try:
        async with httpx.AsyncClient(base_url=g, timeout=30) as c:
            r = await c.post(URL, json=chat_body("short"), headers={"X-TTFT-Target": f"{budget:.6f}"})
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("rate_limit_error", "ttft_budget_exceeded")
            assert r.headers["retry-after"] == str(max(1, round(projected - budget)))
            assert counter(await status(g), "refused", "ttft_budget_exceeded") == before + 1
            # the same request with a budget above the projection is admitted
            r = await c.post(URL, json=chat_body("short"), headers={"X-TTFT-Target": f"{projected + 1:.3f}"})
            assert r.status_code == 200, r.text
    finally:
        await held.cancel()
    await wait_status(g, balanced, "counters balance and permits are back")
    snap = await status(g)
    assert all(e["pending_prefill_tokens"] == 0 for e in snap["engines"])
