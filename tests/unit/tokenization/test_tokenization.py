"""Router-side tokenization: vLLM's conversation rules, content formats, the estimate fallback,
sizing off the event loop, and the contract's prompt-alone row for a CJK prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.tokenization import estimate_tokens
from narwhal_serve.tokenization.chat import NotExact, content_format, conversation, tool_dicts
from narwhal_serve.tokenization.hf import HfTokenizer
from narwhal_serve.tokenization.sizer import INLINE_CHARS, PromptSizer
from tests.support.local_router import LocalRouter, start_local_router
from tests.support.tokenizer import prompt_threads

CJK = "東京は日本の首都です。数据中心的路由器。"


def test_cjk_prompts_are_several_times_the_estimate(tok: HfTokenizer) -> None:
    text = CJK * 20
    exact = len(tok.encode(text, add_special_tokens=False))
    assert exact > 4 * estimate_tokens(len(text)), (exact, estimate_tokens(len(text)))
    english = "the quick brown fox jumps over the lazy dog " * 20
    assert len(tok.encode(english, add_special_tokens=False)) < 2 * estimate_tokens(len(english))


def test_chat_is_rendered_with_the_template_and_no_special_tokens(tok: HfTokenizer) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}
    assert tok.render_chat(body) == "<|system|>\nbe brief<|end|>\n<|user|>\nhello<|end|>\n<|assistant|>\n"
    ids = tok.prompt("chat", body).ids
    assert ids == tok.encode(tok.render_chat(body), add_special_tokens=False)
    assert ids[0] != tok.encode("", add_special_tokens=True)[0]  # no BOS: vLLM's chat default
    no_gen = tok.render_chat({**body, "add_generation_prompt": False})
    assert not no_gen.endswith("<|assistant|>\n")


def test_completion_prompts_get_special_tokens_unless_asked(tok: HfTokenizer) -> None:
    bos = tok.encode("", add_special_tokens=True)
    assert tok.prompt("completion", {"prompt": "hi there"}).ids[: len(bos)] == bos
    assert tok.prompt("completion", {"prompt": ["hi there"], "add_special_tokens": False}).ids == tok.encode("hi there", False)


def test_tools_and_tool_calls_reach_the_template_as_vllm_shapes_them(tok: HfTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}]
    assert tool_dicts(tools) == [{"type": "function", "function": {"name": "f", "description": None,
                                                                   "parameters": {"type": "object"}, "strict": True}}]
    body = {"tools": tools, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    text = tok.render_chat(body)
    assert '"description": null' in text  # model_dump keeps the unset description
    assert '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>' in text  # arguments parsed to an object
    assert "<|tool|>\na\nb<|end|>" in text  # list content of a tool message joined


def test_conversation_rules() -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    conv = conversation([{"role": "developer", "content": "d"}, {"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "input_text", "text": "y"}],
                          "name": "n"},
                         {"role": "assistant", "content": "", "tool_calls": []}], "string", template)
    # developer → system for a template that does not know it, then all system messages merged first
    assert conv[0] == {"role": "system", "content": "d\n\ns"}
    assert conv[1] == {"role": "user", "content": "x\ny", "name": "n"}
    assert "tool_calls" not in conv[2]  # an empty list is dropped
    wrapped = conversation([{"role": "user", "content": "x"}], "openai", template)
    assert wrapped[0]["content"] == [{"type": "text", "text": "x"}]
    with pytest.raises(NotExact):
        conversation([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], "string", template)
    billing = conversation([{"role": "system", "content": "x-anthropic-billing-header: cch=1\nrest"}], "string", template)
    assert billing[0]["content"] == "rest"


def test_content_format_is_read_from_the_template() -> None:
    assert content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    looping = "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
    assert content_format(looping) == "openai"
    via_set = "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    assert content_format(via_set) == "openai"
    assert content_format("{% for m in messages %") == "string"  # unparsable: vLLM's default


def test_requests_the_router_cannot_render_exactly_fall_back_to_the_estimate(tok: HfTokenizer) -> None:
    sizer = PromptSizer(tok)
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}'
    sized = asyncio.run(sizer.size(parse_request("chat", raw, model="m")))
    assert sized.method == "estimate" and sized.ids is None
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}'
    assert asyncio.run(sizer.size(parse_request("chat", raw, model="m"))).method == "estimate"
    raw = b'{"model": "m", "prompt": [1, 2, 3]}'
    ids_sized = asyncio.run(sizer.size(parse_request("completion", raw, model="m")))
    assert (ids_sized.method, ids_sized.ids, ids_sized.parsed.prompt_tokens) == ("client_ids", [1, 2, 3], 3)
    no_tok = asyncio.run(PromptSizer(None).size(parse_request("completion", b'{"model": "m", "prompt": "abcdefgh"}', model="m")))
    assert (no_tok.method, no_tok.parsed.prompt_tokens) == ("estimate", 2)


def test_long_prompts_are_tokenized_off_the_event_loop(tok: HfTokenizer) -> None:
    sizer = PromptSizer(tok)

    async def both() -> tuple[Any, Any]:
        short = parse_request("completion", b'{"model": "m", "prompt": "short"}', model="m")
        long_text = CJK * (INLINE_CHARS // len(CJK) + 1)
        long = parse_request("completion", ('{"model": "m", "prompt": "%s"}' % long_text).encode(), model="m")
        return await sizer.size(short), await sizer.size(long)

    with prompt_threads(tok) as threads:
        short, long = asyncio.run(both())
    assert threads[0] == "MainThread" and threads[1].startswith("narwhal-tokenize")
    assert short.method == long.method == "tokenizer"
    assert long.parsed.prompt_tokens == len(tok.encode(CJK * (INLINE_CHARS // len(CJK) + 1), True))


# ----------------------------------------------------------------------------- through the router


@pytest.fixture(scope="module")
async def routers(tok_dir: Path) -> AsyncIterator[tuple[LocalRouter, LocalRouter]]:
    fleet = {"engines": [{"name": "u0", "role": "unified"}]}
    exact = await start_local_router({"tokenizer": str(tok_dir), "sim": fleet})
    blind = await start_local_router({"tokenizer": "estimate", "sim": fleet})
    yield exact, blind
    await exact.stop()
    await blind.stop()


async def test_cjk_prompt_alone_over_budget_is_refused_only_with_exact_tokens(
        routers: tuple[LocalRouter, LocalRouter], tok: HfTokenizer) -> None:
    """The contract's prompt-alone row: a CJK prompt whose character estimate fits the TTFT budget and
    whose real token count does not is refused up front (and was admitted on the estimate)."""
    exact, blind = routers
    text = CJK * 60
    body = {"model": "narwhal-sim", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    real = len(tok.prompt("chat", body).ids)
    guess = estimate_tokens(len(text) + 4)
    async with httpx.AsyncClient(timeout=30) as c:
        model = (await c.get(exact.url + "/status")).json()["engines"][0]["ttft_model"]
        a, b = model["a_s"], model["b_s_per_token"]
        # a budget between what the estimate and what the real count need on an idle engine
        budget = a + b * (guess + real) / 2
        assert a + b * guess < budget < a + b * real, (a, b, guess, real)
        headers = {"X-TTFT-Target": f"{budget:.6f}"}
        refused = await c.post(exact.url + "/v1/chat/completions", json=body, headers=headers)
        admitted = await c.post(blind.url + "/v1/chat/completions", json=body, headers=headers)
        st = (await c.get(exact.url + "/status")).json()
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "prompt_exceeds_ttft_budget"
    assert admitted.status_code == 200, admitted.text
    assert st["tokenizer"].startswith("hf:")


async def test_tokenize_and_detokenize_routes(routers: tuple[LocalRouter, LocalRouter], tok: HfTokenizer) -> None:
    exact, blind = routers
    msgs = [{"role": "user", "content": "hello " + CJK}]
    async with httpx.AsyncClient(base_url=exact.url, timeout=30) as c:
        # (a request first: this replica's lease then has the engines' view)
        assert (await c.post("/v1/completions", json={"model": "narwhal-sim", "prompt": "hi", "max_tokens": 1})).status_code == 200
        await exact.app_reporter.flush()
        r = await c.post("/tokenize", json={"model": "narwhal-sim", "messages": msgs, "return_token_strs": True})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["tokens"] == tok.prompt("chat", {"messages": msgs}).ids
        # the engines' context (the simulated one's 4096), as vLLM's /tokenize says its own; not the
        # tokenizer's 512
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 4096
        assert len(out["token_strs"]) == out["count"]
        r = await c.post("/tokenize", json={"prompt": "hello"})
        assert r.json()["tokens"] == tok.encode("hello", True) and r.json()["token_strs"] is None
        r = await c.post("/detokenize", json={"model": "narwhal-sim", "tokens": tok.encode("hello " + CJK, False)})
        assert r.status_code == 200 and r.json() == {"prompt": "hello " + CJK}
        # whole-number floats are token IDs, as the completions route and vLLM's schema take them; no model
        # (or an empty one) is the configured one, as vLLM serves its default
        r = await c.post("/detokenize", json={"model": "", "tokens": [float(t) for t in tok.encode("hello", False)]})
        assert r.status_code == 200 and r.json() == {"prompt": "hello"}, r.text
        for path, bad, param in [("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {"messages": [1]}, "messages.0"),
                                 ("/detokenize", {"tokens": [10**9]}, "tokens.0"), ("/detokenize", {"tokens": "x"}, "tokens"),
                                 ("/detokenize", {"tokens": [1.5]}, "tokens"), ("/tokenize", {"model": 5, "prompt": "x"}, "model"),
                                 ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, "add_special_tokens")]:
            r = await c.post(path, json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, bad, r.text)
        r = await c.post("/tokenize", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await c.post("/tokenize", content=b"{nope")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    async with httpx.AsyncClient(base_url=blind.url, timeout=30) as c:
        r = await c.post("/tokenize", json={"prompt": "hello"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "tokenizer_unavailable"
        assert (await c.get("/status")).json()["tokenizer"] == "estimate"


async def test_the_simulated_fleet_is_sized_with_the_simulators_own_tokenizer() -> None:
    """The embedded fleet's default: the router's prompt IDs equal the simulated engine's."""
    from narwhal_serve.sim.tokenizer import SimTokenizer
    from tests.support.prompts import exactness_requests

    router = await start_local_router({"admission": {"mode": "open"}, "sim": {"engines": [{"name": "u0", "role": "unified"}]}})
    sim = SimTokenizer()
    try:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            assert (await c.get("/status")).json()["tokenizer"] == "narwhal-sim"
            for route, body in exactness_requests(40, "narwhal-sim", seed=3):
                path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
                r = await c.post(path, json={**body, "max_tokens": 2, "return_token_ids": True})
                assert r.status_code == 200, r.text
                out = r.json()
                engine_ids = out.get("prompt_token_ids") or out["choices"][0].get("prompt_token_ids")
                assert engine_ids == sim.prompt(route, body).ids
                t = await c.post("/tokenize", json=body)
                assert t.json()["tokens"] == engine_ids
    finally:
        await router.stop()


async def test_prompt_token_ids_outside_the_vocabulary_and_infinite_targets_are_refused(
        routers: tuple[LocalRouter, LocalRouter], tok: HfTokenizer) -> None:
    exact, _ = routers
    async with httpx.AsyncClient(base_url=exact.url, timeout=30) as c:
        for prompt, param in [([5, 6, tok.vocab_size], "prompt.2"), ([[1, 2**64]], "prompt.0.1")]:
            r = await c.post("/v1/completions", json={"model": "narwhal-sim", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        ok = await c.post("/v1/completions", json={"model": "narwhal-sim", "prompt": [5, 6, tok.vocab_size - 1], "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        for header in ("X-TTFT-Target", "X-Request-Timeout", "X-TPOT-Target"):
            for value in ("inf", "1e400", "nan"):
                r = await c.post("/v1/completions", json={"model": "narwhal-sim", "prompt": "x", "max_tokens": 1},
                                 headers={header: value})
                assert r.status_code == 400 and r.json()["error"]["param"] == header.lower(), (header, value, r.text)


def test_the_segment_cache_is_exact_and_reuses_earlier_turns(tok: HfTokenizer) -> None:
    from tests.support.prompts import exactness_requests

    assert tok.segments is not None  # byte-level BPE, no normalizer: exact by construction, and self-checked
    for route, body in exactness_requests(60, "m", seed=11):
        text = tok.render_chat(body) if route == "chat" else body["prompt"]
        long = text * 30  # past the length where segments are used
        for special in (False, True):
            assert tok.segments.encode(long, special) == list(tok._rust.encode(long, add_special_tokens=special).ids)
    system = "You are a careful assistant. 東京のデータ。 " * 60
    turns = [{"role": "system", "content": system}, {"role": "user", "content": "first question " * 30}]
    first = tok.prompt("chat", {"messages": turns})
    hits = tok.segments.hits
    turns += [{"role": "assistant", "content": "an answer " * 30}, {"role": "user", "content": "and then?"}]
    second = tok.prompt("chat", {"messages": turns})
    assert tok.segments.hits >= hits + 2  # the system prompt and the first question came from the cache
    assert second.ids == list(tok._rust.encode(tok.render_chat({"messages": turns}), add_special_tokens=False).ids)
    assert second.ids[: len(first.ids) - 3] == first.ids[: len(first.ids) - 3]


def test_tokenizers_that_are_not_exact_piecewise_get_no_segment_cache(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from narwhal_serve.tokenization.segments import segmenter

    vocab = {"[UNK]": 0, "<sep>": 1, "hello": 2, "world": 3}
    lower = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    lower.normalizer = normalizers.Lowercase()
    lower.pre_tokenizer = pre_tokenizers.Whitespace()
    lower.add_special_tokens(["<sep>"])
    assert segmenter(lower, ["Hello <sep> World"]) is None  # a normalizer: not exact by construction
    spaced = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    spaced.add_special_tokens(["<sep>"])
    assert segmenter(spaced, ["hello<sep>world"]) is None  # a prefix space added to every piece
