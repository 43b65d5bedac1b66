"""The simulator's bodies and chunks have exactly the shapes recorded from vLLM 0.32.0."""

from __future__ import annotations

import re

from sim_testutil import (
    CHAT,
    COMPLETIONS,
    FIXTURES,
    chat_body,
    completion_body,
    keys_only,
    load_json,
    load_sse,
    parse_sse,
    shape,
    sim_client,
)

TINY = {"model": "tiny", "max_model_len": 512}


def _assert_stream_matches(ours: list[object], fixture: list[object]) -> None:
    assert ours[-1] == "[DONE]" and fixture[-1] == "[DONE]"
    assert len(ours) == len(fixture)
    for mine, theirs in zip(ours, fixture):
        assert shape(mine) == shape(theirs)


async def test_chat_stream_plain_shape() -> None:
    async with sim_client(**TINY) as c:
        r = await c.post(CHAT, json=chat_body(stream=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    _assert_stream_matches(parse_sse(r.text), load_sse("chat_stream_plain.sse"))


async def test_chat_stream_logprobs_token_ids_usage_shape() -> None:
    body = chat_body(stream=True, logprobs=True, top_logprobs=2, return_token_ids=True,
                     stream_options={"include_usage": True})
    async with sim_client(**TINY) as c:
        r = await c.post(CHAT, json=body)
    ours = parse_sse(r.text)
    _assert_stream_matches(ours, load_sse("chat_stream_logprobs_tokenids_usage.sse"))
    assert ours[0]["prompt_token_ids"] and all(isinstance(i, int) for i in ours[0]["prompt_token_ids"])
    assert ours[-2]["usage"] == {"prompt_tokens": len(ours[0]["prompt_token_ids"]),
                                 "total_tokens": len(ours[0]["prompt_token_ids"]) + 6, "completion_tokens": 6}
    for ev in ours[1:-2]:
        assert len(ev["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
        assert len(ev["choices"][0]["token_ids"]) == 1


async def test_chat_stream_stop_string_shape() -> None:
    async with sim_client(**TINY) as c:
        plain = (await c.post(CHAT, json=chat_body(max_tokens=1))).json()
        first = plain["choices"][0]["message"]["content"]
        stop = first[-1]
        r = await c.post(CHAT, json=chat_body(stream=True, return_token_ids=True, stop=[stop], max_tokens=20))
    ours = parse_sse(r.text)
    _assert_stream_matches(ours, load_sse("chat_stream_stop_string.sse"))
    choice = ours[1]["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["delta"]["content"] == first[: first.index(stop)]


async def test_chat_nonstream_shape() -> None:
    async with sim_client(**TINY) as c:
        r = await c.post(CHAT, json=chat_body(logprobs=True, top_logprobs=2, return_token_ids=True))
    assert shape(r.json()) == shape(load_json("chat_nonstream_logprobs_tokenids.json"))


async def test_completion_stream_shape() -> None:
    body = completion_body(stream=True, logprobs=2, return_token_ids=True, stream_options={"include_usage": True})
    async with sim_client(**TINY) as c:
        r = await c.post(COMPLETIONS, json=body)
    ours = parse_sse(r.text)
    fixture = load_sse("completion_stream_logprobs_tokenids_usage.sse")
    _assert_stream_matches(ours, fixture)
    # prompt_token_ids on the first chunk only; text offsets accumulate
    assert ours[0]["choices"][0]["prompt_token_ids"][0] == 0
    assert all(ev["choices"][0]["prompt_token_ids"] is None for ev in ours[1:-2])
    offsets = [ev["choices"][0]["logprobs"]["text_offset"][0] for ev in ours[:-2]]
    texts = [ev["choices"][0]["text"] for ev in ours[:-2]]
    assert offsets == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert all(len(ev["choices"][0]["logprobs"]["top_logprobs"][0]) == 3 for ev in ours[:-2])


async def test_completion_stream_without_token_ids_has_null_keys() -> None:
    async with sim_client(**TINY) as c:
        r = await c.post(COMPLETIONS, json=completion_body(stream=True, max_tokens=3))
    events = parse_sse(r.text)
    assert len(events) == 4
    for ev in events[:-1]:
        ch = ev["choices"][0]
        assert ch["prompt_token_ids"] is None and ch["token_ids"] is None and ch["logprobs"] is None
    assert "system_fingerprint" in events[-2] and "system_fingerprint" not in events[0]


async def test_completion_nonstream_shape() -> None:
    async with sim_client(**TINY) as c:
        r = await c.post(COMPLETIONS, json=completion_body(logprobs=2, return_token_ids=True))
        plain = await c.post(COMPLETIONS, json=completion_body(max_tokens=1))
    body = r.json()
    assert shape(body) == shape(load_json("completion_nonstream_logprobs_tokenids.json"))
    ch = body["choices"][0]
    assert ch["text"] == "".join(ch["logprobs"]["tokens"])
    assert shape(plain.json()) == shape(load_json("completion_prefill_leg_no_connector.json"))


async def test_prefill_leg_key_set() -> None:
    body = completion_body(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    async with sim_client(**TINY) as c:
        r = await c.post(COMPLETIONS, json=body, headers={"X-Request-Id": "req-1"})
    got = r.json()
    fixture = load_json("completion_prefill_leg_no_connector.json")
    assert {k: keys_only(v) for k, v in got.items() if k != "kv_transfer_params"} == {
        k: keys_only(v) for k, v in fixture.items() if k != "kv_transfer_params"}
    assert got.keys() == fixture.keys()


async def test_errors_match_vllm_envelopes() -> None:
    async with sim_client(**TINY) as c:
        bad = await c.post(CHAT, json={"model": "tiny", "messages": "x"})
        missing = await c.post(CHAT, json=chat_body(model="other"))
        too_many = await c.post(COMPLETIONS, json=completion_body(max_tokens=100000))
    assert bad.status_code == 400 and bad.json() == load_json("error_bad_body.json")
    assert missing.status_code == 404 and missing.json() == load_json("error_model_not_found.json")
    assert too_many.status_code == 400 and too_many.json() == load_json("error_too_many_tokens.json")


async def test_models_tokenize_health() -> None:
    async with sim_client(**TINY) as c:
        models = (await c.get("/v1/models")).json()
        tok = (await c.post("/tokenize", json={"model": "tiny", "prompt": "Hello, my name is"})).json()
        health = await c.get("/health")
        comp = (await c.post(COMPLETIONS, json=completion_body(max_tokens=1, return_token_ids=True))).json()
    assert shape(models) == shape(load_json("models.json"))
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
    assert shape(tok) == shape(load_json("tokenize.json"))
    assert tok["tokens"] == comp["choices"][0]["prompt_token_ids"] and tok["count"] == len(tok["tokens"])
    assert health.status_code == 200 and health.content == b""


async def test_metrics_has_vllm_series() -> None:
    async with sim_client(**TINY) as c:
        await c.post(CHAT, json=chat_body())
        text = (await c.get("/metrics")).text
    series = {line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    excerpt = (FIXTURES / "metrics_excerpt.txt").read_text().split()
    names = [tok for tok in excerpt if tok.startswith("vllm:")]
    assert names and all(name in series for name in names)
    assert re.search(r'^vllm:generation_tokens_total\{engine="0",model_name="tiny"\} 6\.0$', text, re.M)
    assert re.search(r'^vllm:request_success_total\{engine="0",finished_reason="length",model_name="tiny"\} 1\.0$',
                     text, re.M)

