"""The context row end to end, in-process (scheduler, gateway and simulated engines): the
scheduler learns each engine's context from its ``/v1/models``; a prompt the router counts exactly
that leaves no engine room for output gets 400 ``context_length_exceeded`` at once, counted as an
invalid request, before any engine sees it (it used to be a 429 ``prompt_exceeds_ttft_budget``
under predictive admission, or the engine's 400 after a permit and a placement)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from narwhal_serve.sim.tokenizer import SimTokenizer
from tests.support.local_router import LocalRouter, start_local_router

CHAT = "/v1/chat/completions"
CONTEXT = 256


@pytest.fixture(scope="module")
async def router() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({"sim": {"engines": [{"name": "u0", "max_model_len": CONTEXT},
                                                      {"name": "u1", "max_model_len": CONTEXT}]}})
    yield r
    await r.stop()


def chat_of(tokens: int) -> dict[str, object]:
    """A chat whose prompt is exactly ``tokens`` tokens for the simulated engines' tokenizer."""
    tok = SimTokenizer()
    words = tokens
    while True:
        body = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "word " * words}], "max_tokens": 2}
        n = len(tok.prompt("chat", body).ids)
        if n == tokens:
            return body
        assert n > tokens or words < 10 * tokens, n
        words += 1 if n < tokens else -1
        if words <= 0:
            raise AssertionError(f"no prompt of exactly {tokens} tokens")


async def test_the_scheduler_knows_each_engines_context_from_its_model_card(router: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        st = (await c.get("/status")).json()
    assert [e["max_model_len"] for e in st["engines"]] == [CONTEXT, CONTEXT]


async def test_a_prompt_filling_the_context_is_a_400_before_any_engine(router: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        over = await c.post(CHAT, json=chat_of(CONTEXT))
        fits = await c.post(CHAT, json=chat_of(CONTEXT - 8))
        await router.app_reporter.flush()
        metrics = (await c.get("/metrics")).text
    assert over.status_code == 400, over.text
    err = over.json()["error"]
    # (the router's envelope: an engine's own refusal would say BadRequestError, code 400)
    assert (err["code"], err["type"], err["param"]) == ("context_length_exceeded", "invalid_request_error", "messages")
    assert f"maximum context length is {CONTEXT} tokens" in err["message"] and f"has {CONTEXT} tokens" in err["message"]
    assert "retry-after" not in over.headers
    assert fits.status_code == 200, fits.text
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith('narwhal_invalid_requests_total{reason="context_length_exceeded"}'))
    assert float(line.split()[-1]) >= 1


async def test_an_output_limit_past_the_context_is_a_400_before_any_engine(router: LocalRouter) -> None:
    """(Found by a hostile probe.) It was admitted, placed and refused by the engine."""
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        sent = [x for u in ("u0", "u1") for x in router.sim(u).engine.recent]
        chat = await c.post(CHAT, json={**chat_of(20), "max_completion_tokens": CONTEXT + 1, "max_tokens": 4})
        completion = await c.post("/v1/completions", json={"model": "narwhal-sim", "prompt": "hi", "max_tokens": 10**6})
        null = await c.post(CHAT, json={**chat_of(20), "max_completion_tokens": None, "max_tokens": CONTEXT + 1})
        fits = await c.post(CHAT, json={**chat_of(20), "max_tokens": CONTEXT})
    for r, param, asked in ((chat, "max_completion_tokens", CONTEXT + 1), (completion, "max_tokens", 10**6),
                            (null, "max_tokens", CONTEXT + 1)):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", param)
        assert err["message"].startswith(f"{param}={asked} cannot be greater than max_model_len={CONTEXT}.")
    assert fits.status_code == 200, fits.text
    assert len([x for u in ("u0", "u1") for x in router.sim(u).engine.recent]) == len(sent) + 1  # only the one that fits


async def test_model_card_and_tokenize_say_the_engines_context_as_vllm_does(router: LocalRouter) -> None:
    """vLLM's ``/v1/models`` card and ``/tokenize`` carry ``max_model_len``: the router's say the
    engines' own once its lease has seen them (they used to omit it, and ``/tokenize`` said the
    tokenizer's)."""
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        assert (await c.post(CHAT, json=chat_of(40))).status_code == 200  # (the lease's first view)
        await router.app_reporter.flush()
        card = (await c.get("/v1/models")).json()["data"][0]
        one = (await c.get("/v1/models/narwhal-sim")).json()
        tokenized = (await c.post("/tokenize", json={"prompt": "hello"})).json()
    assert card["max_model_len"] == one["max_model_len"] == tokenized["max_model_len"] == CONTEXT
