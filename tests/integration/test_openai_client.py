"""Issue 2: the graph end to end with the official openai client (chat and completions, stream and not,
token-ID exposure, P/D with kv_transfer_params)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.conftest import MODEL, Graph
from tests.integration.helpers import without_engine

MSGS = [{"role": "user", "content": "Tell me about narwhals."}]


def client(graph: Graph) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=graph.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_models_health_ready(graph: Graph) -> None:
    models = await client(graph).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client(graph).models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as gone:
        await client(graph).models.retrieve("not-" + MODEL)
    assert gone.value.code == "model_not_found"
    async with httpx.AsyncClient(base_url=graph.url) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.get("/ready")
        assert r.status_code == 200 and r.json() == {"ready": True, "state": "active"}


async def test_chat_nonstream(graph: Graph) -> None:
    r = await client(graph).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=7, seed=3)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage is not None and r.usage.completion_tokens <= 7 and r.usage.prompt_tokens > 0
    extra = r.model_extra or {}
    assert extra.get("prompt_token_ids") is None and "kv_transfer_params" not in extra  # (not asked: null, as vLLM)
    assert (r.choices[0].model_extra or {}).get("token_ids") is None


async def test_chat_stream_equals_nonstream_with_token_ids(graph: Graph) -> None:
    c = client(graph)
    body = dict(model=MODEL, messages=MSGS, max_tokens=8, seed=11, extra_body={"return_token_ids": True})
    full = await c.chat.completions.create(**body)  # type: ignore[call-overload]
    stream = await c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body)  # type: ignore[call-overload]
    text, ids, prompt_ids, usage, finish = "", [], None, None, None
    async for chunk in stream:
        extra = chunk.model_extra or {}
        assert "kv_transfer_params" not in extra
        if extra.get("prompt_token_ids"):
            prompt_ids = extra["prompt_token_ids"]
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            ids += (ch.model_extra or {}).get("token_ids") or []
            finish = ch.finish_reason or finish
    fx = full.choices[0].model_extra or {}
    assert text == full.choices[0].message.content
    assert ids == fx["token_ids"] and len(ids) == full.usage.completion_tokens  # type: ignore[union-attr]
    assert prompt_ids == (full.model_extra or {})["prompt_token_ids"]
    assert usage is not None and usage.completion_tokens == len(ids)
    assert finish == full.choices[0].finish_reason


async def test_chat_stream_without_ids_hides_them_and_usage(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    body = r.text
    assert body.rstrip().endswith("data: [DONE]")
    assert '"token_ids":[' not in body and '"prompt_token_ids":[' not in body  # (null, as vLLM streams them)
    assert '"token_ids":null' in body and "kv_transfer_params" not in body and '"usage"' not in body


@pytest.mark.parametrize("stream", [False, True])
async def test_completions(graph: Graph, stream: bool) -> None:
    c = client(graph)
    kw = dict(model=MODEL, prompt="Narwhals are", max_tokens=6, seed=5, extra_body={"return_token_ids": True})
    if not stream:
        r = await c.completions.create(**kw)  # type: ignore[call-overload]
        assert r.object == "text_completion" and r.choices[0].text
        assert len((r.choices[0].model_extra or {})["token_ids"]) == r.usage.completion_tokens  # type: ignore[union-attr]
        assert (r.choices[0].model_extra or {})["prompt_token_ids"]
        return
    text, ids = "", []
    async for chunk in await c.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        for ch in chunk.choices:
            text += ch.text
            ids += (ch.model_extra or {}).get("token_ids") or []
    assert text and len(ids) == 6


async def test_request_id_is_kept_and_sent_to_both_pd_legs(graph: Graph) -> None:
    """With the unified engine deregistered at run time, requests go through the P/D pair: the
    decode leg carries the prefill answer's kv_transfer_params verbatim, with the same X-Request-Id."""
    async with without_engine(graph.url, graph.unified_engine()), httpx.AsyncClient(timeout=30) as c:
        await _pd_requests(graph, c)


async def _pd_requests(graph: Graph, c: httpx.AsyncClient) -> None:
    rids = []
    for i in range(4):
        rid = f"test-pd-{i}"
        r = await c.post(graph.url + "/v1/completions", headers={"X-Request-Id": rid},
                         json={"model": MODEL, "prompt": f"pd {i}", "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        rids.append(rid)
    pre = (await c.get(graph.sim_url(0) + "/sim/stats")).json()
    dec = (await c.get(graph.sim_url(1) + "/sim/stats")).json()
    pre_by_id = {x["request_id"]: x["body"] for x in pre["requests"] if x["request_id"] in rids}
    dec_by_id = {x["request_id"]: x["body"] for x in dec["requests"] if x["request_id"] in rids}
    assert len(pre_by_id) == 4, "every request goes through the P/D pair"
    assert set(pre_by_id) == set(dec_by_id)
    for rid, pbody in pre_by_id.items():
        assert pbody["stream"] is False and pbody["max_tokens"] == 1
        assert pbody["kv_transfer_params"] == {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }
        assert "stream_options" not in pbody and "min_tokens" not in pbody
        kv = dec_by_id[rid]["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == "sim-prefill-0"
        assert kv["request_id"] == rid
        assert dec_by_id[rid]["return_token_ids"] is True and dec_by_id[rid]["stream_interval"] == 1
