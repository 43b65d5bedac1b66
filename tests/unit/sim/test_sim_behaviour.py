"""Determinism, stop/EOS/min_tokens, token-id placement, P/D legs, dialects, scripts, control, stats."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from sim_testutil import CHAT, COMPLETIONS, chat_body, completion_body, content_chunks, parse_sse, sim_client

from narwhal_serve.config.sim import SCRIPT_NAMES, SimEngineConfig
from narwhal_serve.sim.scripts import TOOL_CALLS


def _stream_ids(events: list[Any]) -> list[int]:
    return [i for ev in content_chunks(events) for i in ev["choices"][0]["token_ids"]]


async def test_token_ids_placement_with_and_without_request() -> None:
    async with sim_client() as c:
        without = parse_sse((await c.post(CHAT, json=chat_body(model=None, stream=True))).text)
        with_ids = parse_sse((await c.post(CHAT, json=chat_body(model=None, stream=True, return_token_ids=True))).text)
        ns_without = (await c.post(CHAT, json=chat_body(model=None))).json()
        comp = parse_sse((await c.post(COMPLETIONS, json=completion_body(model=None, stream=True,
                                                                         return_token_ids=True))).text)
    assert without[0]["prompt_token_ids"] is None
    assert all(ev["choices"][0]["token_ids"] is None for ev in content_chunks(without))
    assert isinstance(with_ids[0]["prompt_token_ids"], list) and "token_ids" not in with_ids[0]["choices"][0]
    assert all("prompt_token_ids" not in ev for ev in with_ids[1:-1])
    assert all(len(ev["choices"][0]["token_ids"]) == 1 for ev in content_chunks(with_ids))
    assert ns_without["prompt_token_ids"] is None and ns_without["choices"][0]["token_ids"] is None
    assert comp[0]["choices"][0]["prompt_token_ids"] and comp[1]["choices"][0]["prompt_token_ids"] is None


async def test_same_seed_same_tokens_stream_and_nonstream() -> None:
    async with sim_client(model="tiny") as c:
        for path, make in ((CHAT, chat_body), (COMPLETIONS, completion_body)):
            body = make(seed=7, max_tokens=12, return_token_ids=True)
            ns = (await c.post(path, json=body)).json()
            st = parse_sse((await c.post(path, json={**body, "stream": True})).text)
            assert ns["choices"][0]["token_ids"] == _stream_ids(st)
            key = "text" if path == COMPLETIONS else "content"
            st_text = "".join(ev["choices"][0].get("text", ev["choices"][0].get("delta", {}).get("content", ""))
                              for ev in content_chunks(st))
            ns_text = ns["choices"][0]["text"] if key == "text" else ns["choices"][0]["message"]["content"]
            assert ns_text == st_text
            other = (await c.post(path, json={**body, "seed": 8})).json()
            assert other["choices"][0]["token_ids"] != ns["choices"][0]["token_ids"]
            again = (await c.post(path, json=body)).json()
            assert again["choices"][0]["token_ids"] == ns["choices"][0]["token_ids"]


async def test_stop_min_tokens_and_eos() -> None:
    async with sim_client(model="tiny") as c:
        base = (await c.post(CHAT, json=chat_body(max_tokens=8, return_token_ids=True))).json()
        text = base["choices"][0]["message"]["content"]
        stop = text[1]
        cut = (await c.post(CHAT, json=chat_body(max_tokens=8, stop=stop, return_token_ids=True))).json()
        held = (await c.post(CHAT, json=chat_body(max_tokens=8, stop=[stop], min_tokens=3,
                                                  return_token_ids=True))).json()
    ch = cut["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    assert ch["message"]["content"] == text[: text.index(stop)] and len(ch["token_ids"]) == 1
    assert len(held["choices"][0]["token_ids"]) >= 3
    async with sim_client(eos_prob=1.0) as c:
        eos = (await c.post(CHAT, json=chat_body(model=None, ignore_eos=False, return_token_ids=True))).json()
        no_eos = (await c.post(CHAT, json=chat_body(model=None, ignore_eos=True))).json()
        min_eos = (await c.post(CHAT, json=chat_body(model=None, ignore_eos=False, min_tokens=4))).json()
    assert eos["choices"][0]["finish_reason"] == "stop" and eos["choices"][0]["stop_reason"] is None
    assert eos["choices"][0]["token_ids"] == [2] and eos["usage"]["completion_tokens"] == 1
    assert no_eos["choices"][0]["finish_reason"] == "length" and no_eos["usage"]["completion_tokens"] == 6
    assert min_eos["usage"]["completion_tokens"] == 5


async def test_default_and_chat_max_completion_tokens() -> None:
    async with sim_client(default_max_tokens=5, eos_prob=0.0) as c:
        d = (await c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})).json()
        m = (await c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                                      "max_completion_tokens": 3})).json()
        n2 = await c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "n": 2})
        # a completion without max_tokens ends at vLLM's 16; with an explicit null it runs as a chat
        plain = (await c.post(COMPLETIONS, json={"prompt": "x"})).json()
        null = (await c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": None, "min_tokens": 30})).json()
    assert d["usage"]["completion_tokens"] == 5 and m["usage"]["completion_tokens"] == 3
    # (the null one: its 30 tokens, then it stops by itself: an EOS)
    assert plain["usage"]["completion_tokens"] == 16 and null["usage"]["completion_tokens"] == 31
    assert d["choices"][0]["finish_reason"] == null["choices"][0]["finish_reason"] == "stop"
    assert n2.status_code == 400 and n2.json()["error"]["param"] == "n"


async def test_pd_prefill_leg_and_decode_leg() -> None:
    prompt = "word " * 40
    async with sim_client(name="p0", role="prefill") as pc, sim_client(name="d0", role="decode") as dc:
        body = {"prompt": prompt, "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        pr = (await pc.post(COMPLETIONS, json=body, headers={"X-Request-Id": "rid-42"})).json()
        kvp = pr["kv_transfer_params"]
        n_prompt = pr["usage"]["prompt_tokens"]
        assert pr["usage"]["completion_tokens"] == 1
        assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
        assert kvp["remote_engine_id"] == "p0" and kvp["request_id"] == "rid-42" and kvp["tp_size"] == 1
        assert kvp["remote_host"] == "127.0.0.1" and isinstance(kvp["remote_port"], int)
        assert len(kvp["remote_block_ids"]) == math.ceil(n_prompt / 16)
        assert all(isinstance(b, int) for b in kvp["remote_block_ids"])
        decode_body = {"prompt": prompt, "max_tokens": 4, "stream": True, "kv_transfer_params": kvp}
        dr = await dc.post(COMPLETIONS, json=decode_body, headers={"X-Request-Id": "rid-42"})
        events = parse_sse(dr.text)
        assert events[-1] == "[DONE]" and len(events) == 5
        assert all("kv_transfer_params" not in json.dumps(ev) for ev in events)
        plain = (await dc.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 2})).json()
        assert plain["kv_transfer_params"] is None and plain["usage"]["completion_tokens"] == 2
        stats = (await dc.get("/sim/stats")).json()
    got = stats["requests"][0]
    assert got["request_id"] == "rid-42" and got["path"] == COMPLETIONS
    assert got["body"]["kv_transfer_params"] == kvp and stats["total_requests"] == 2


async def test_sglang_dialect() -> None:
    async with sim_client(dialect="sglang", role="prefill") as pc, sim_client(dialect="sglang", role="decode") as dc:
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
        pr = await pc.post(CHAT, json=chat_body(model=None, stream=True, max_tokens=10, **boot))
        assert pr.headers["content-type"].startswith("application/json")
        body = pr.json()
        assert body["usage"]["completion_tokens"] == 1 and "token_ids" not in body["choices"][0]
        assert "kv_transfer_params" not in body and "prompt_token_ids" not in body
        dr = parse_sse((await dc.post(CHAT, json=chat_body(model=None, stream=True, **boot))).text)
        assert len(content_chunks(dr)) == 6 and "token_ids" not in dr[1]["choices"][0]
        asked = parse_sse((await dc.post(CHAT, json=chat_body(model=None, stream=True,
                                                              return_token_ids=True))).text)
        assert len(asked[1]["choices"][0]["token_ids"]) == 1
        assert (await dc.get("/sim/stats")).json()["requests"][0]["body"]["bootstrap_room"] == 12345


async def test_openai_dialect_never_sends_token_ids() -> None:
    async with sim_client(dialect="openai") as c:
        st = (await c.post(CHAT, json=chat_body(model=None, stream=True, return_token_ids=True))).text
        ns = (await c.post(COMPLETIONS, json=completion_body(model=None, return_token_ids=True))).json()
    assert "token_ids" not in st and "prompt_text" not in st and "stop_reason" not in st
    assert "token_ids" not in json.dumps(ns) and "kv_transfer_params" not in ns
    assert parse_sse(st)[-1] == "[DONE]"


def _deltas(events: list[Any]) -> list[dict[str, Any]]:
    return [ev["choices"][0]["delta"] for ev in content_chunks(events)]


@pytest.mark.parametrize("script", sorted(SCRIPT_NAMES))
async def test_scripts_stream_and_nonstream(script: str) -> None:
    async with sim_client() as c:
        body = chat_body(model=None, return_token_ids=True, sim={"script": script})
        events = parse_sse((await c.post(CHAT, json={**body, "stream": True})).text)
        ns = (await c.post(CHAT, json=body)).json()
    deltas, chunks = _deltas(events), content_chunks(events)
    assert all(len(ev["choices"][0]["token_ids"]) == 1 for ev in chunks)
    assert ns["choices"][0]["token_ids"] == _stream_ids(events)
    msg, finish = ns["choices"][0]["message"], chunks[-1]["choices"][0]["finish_reason"]
    assert ns["choices"][0]["finish_reason"] == finish
    if script in ("reasoning", "reasoning_content"):
        assert deltas[0].keys() == {script} and deltas[-1].keys() == {"content"}
        assert msg[script] == "".join(d.get(script, "") for d in deltas)
        assert msg["content"] == "".join(d.get("content", "") for d in deltas)
    elif script == "refusal":
        assert all(d.keys() == {"refusal"} for d in deltas)
        assert msg["refusal"] == "I'm sorry, but I can't help with that." and msg["content"] is None
    elif script == "tool_calls":
        assert finish == "tool_calls"
        firsts = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
        assert [f["index"] for f in firsts] == [0, 1]
        for f, (name, _) in zip(firsts, TOOL_CALLS):
            assert f["id"].startswith("chatcmpl-tool-") and f["type"] == "function"
            assert f["function"] == {"name": name, "arguments": ""}
        later = [d["tool_calls"][0] for d in deltas if "id" not in d["tool_calls"][0]]
        assert all(call.keys() == {"index", "function"} and call["function"].keys() == {"arguments"}
                   for call in later)
        args = [json.loads(call["function"]["arguments"]) for call in msg["tool_calls"]]
        assert args == [{"city": "Paris", "unit": "celsius"}, {"timezone": "UTC"}]
        assert [call["id"] for call in msg["tool_calls"]] == [f["id"] for f in firsts]
    else:
        assert finish == "function_call" and deltas[0] == {"function_call": {"name": "get_weather", "arguments": ""}}
        assert all(d["function_call"].keys() == {"arguments"} for d in deltas[1:])
        assert json.loads(msg["function_call"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


async def test_control_and_stats() -> None:
    async with sim_client() as c:
        r = await c.post("/sim/control", json={"tpot_base_s": 0.0, "faults": ["unhealthy"]})
        assert r.status_code == 200 and r.json()["tpot_base_s"] == 0.0 and r.json()["faults"] == ["unhealthy"]
        assert (await c.get("/health")).status_code == 503
        assert (await c.post("/sim/control", json={"faults": []})).status_code == 200
        assert (await c.get("/health")).status_code == 200
        bad = await c.post("/sim/control", json={"faults": ["nope"]})
        assert bad.status_code == 400 and (await c.get("/sim/control")).json()["faults"] == []
        assert (await c.post("/sim/control", json={"bogus": 1})).status_code == 400
        for i in range(55):
            await c.post(COMPLETIONS, json={"prompt": f"p{i}", "max_tokens": 1}, headers={"X-Request-Id": f"r{i}"})
        stats = (await c.get("/sim/stats")).json()
    assert stats["total_requests"] == 55 and len(stats["requests"]) == 50
    assert stats["requests"][-1]["request_id"] == "r54" and stats["requests"][0]["body"]["prompt"] == "p5"
    assert stats["running"] == 0 and stats["waiting"] == 0


async def test_bad_sim_extension_and_prompt_forms() -> None:
    async with sim_client() as c:
        assert (await c.post(CHAT, json=chat_body(model=None, sim={"script": "x"}))).status_code == 400
        assert (await c.post(CHAT, json=chat_body(model=None, sim={"fault": "x"}))).status_code == 400
        assert (await c.post(CHAT, json=chat_body(model=None, sim={"what": 1}))).status_code == 400
        assert (await c.post(CHAT, content=b"{nope")).status_code == 400
        ids = (await c.post(COMPLETIONS, json={"prompt": [0, 5, 9], "max_tokens": 1, "return_token_ids": True}))
        assert ids.json()["choices"][0]["prompt_token_ids"] == [0, 5, 9]
        two = await c.post(COMPLETIONS, json={"prompt": ["a", "b"], "max_tokens": 1})
        assert two.status_code == 400
        parts = await c.post(CHAT, json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                         "max_tokens": 1, "return_token_ids": True})
        plain = await c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                         "return_token_ids": True})
        assert parts.json()["prompt_token_ids"] == plain.json()["prompt_token_ids"]
        long = await c.post(COMPLETIONS, json={"prompt": "w " * 4200, "max_tokens": 2000})
        assert long.status_code == 400 and long.json()["error"]["param"] == "input_tokens"


def test_config_rejects_unknown_fault_and_extra_fields() -> None:
    with pytest.raises(ValueError):
        SimEngineConfig(faults=["nope"])
    with pytest.raises(ValueError):
        SimEngineConfig.model_validate({"bogus": 1})


SAMPLING_REFUSALS = [
    # (route, body, param, message): vLLM 0.32's words (SamplingParams._verify_args and its request
    # models' before-validators), which the simulator used to accept and serve
    ("chat", {"temperature": -0.5}, "temperature", "temperature must be non-negative, got -0.5. (parameter=temperature, value=-0.5)"),
    ("completion", {"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)"),
    ("completion", {"top_p": 2}, "top_p", "top_p must be in (0, 1], got 2.0. (parameter=top_p, value=2.0)"),
    ("chat", {"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"),
    ("completion", {"top_k": -2}, None, "top_k must be 0 (disable), or at least 1, got -2."),
    ("chat", {"presence_penalty": 3}, None, "presence_penalty must be in [-2, 2], got 3.0."),
    ("completion", {"frequency_penalty": -2.5}, None, "frequency_penalty must be in [-2, 2], got -2.5."),
    ("completion", {"repetition_penalty": 0}, None, "repetition_penalty must be greater than zero, got 0.0."),
    ("chat", {"min_p": 1.5}, None, "min_p must be in [0, 1], got 1.5."),
    ("completion", {"min_tokens": 5, "max_tokens": 2}, None, "min_tokens must be less than or equal to max_tokens=2, got 5."),
    ("chat", {"stop": ["x", ""]}, None, "stop cannot contain an empty string."),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    ("completion", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"),
    ("chat", {"temperature": float("nan")}, "temperature",
     "temperature must be a finite number, got nan. (parameter=temperature, value=nan)"),
    ("completion", {"temperature": float("inf")}, "temperature",
     "temperature must be a finite number, got inf. (parameter=temperature, value=inf)"),
    ("chat", {"repetition_penalty": float("nan")}, None, "repetition_penalty must be a finite number, got nan."),
    # both wrong: vLLM's chat model names top_logprobs first
    ("chat", {"top_logprobs": 2, "stream_options": {"include_usage": True}}, "top_logprobs",
     "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"),
]


@pytest.mark.parametrize("route,extra,param,message", SAMPLING_REFUSALS)
async def test_sampling_values_vllm_refuses_are_refused_in_its_words(route: str, extra: dict[str, Any],
                                                                     param: str | None, message: str) -> None:
    body = chat_body(model=None, **extra) if route == "chat" else completion_body(model=None, **extra)
    async with sim_client() as c:
        # (json.dumps writes NaN and Infinity as Python's json, and vLLM's server, read them)
        r = await c.post(CHAT if route == "chat" else COMPLETIONS, content=json.dumps(body).encode(),
                         headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}


async def test_sampling_values_at_their_bounds_are_served() -> None:
    """The edges vLLM takes: top_k -1 (off) and 0, top_p 1, temperature 0 and 2, penalties ±2,
    min_tokens = max_tokens, top_logprobs 0 without logprobs, stream_options {} without stream."""
    async with sim_client() as c:
        for extra in ({"top_k": -1, "top_p": 1, "temperature": 2, "presence_penalty": -2, "frequency_penalty": 2},
                      {"top_k": 0, "temperature": 0, "min_p": 1, "repetition_penalty": 1.5, "min_tokens": 2},
                      {"top_logprobs": 0, "stream_options": {}}):
            r = await c.post(CHAT, json=chat_body(model=None, max_tokens=2, **extra))
            assert r.status_code == 200, (extra, r.text)


async def test_without_max_tokens_min_tokens_is_checked_against_vllms_own_default() -> None:
    """(Found by a review.) Unasked, vLLM's limit is the context left for a chat and 16 tokens for a
    completion: a chat's ``min_tokens`` past 16 is served (and honoured), a completion's refused."""
    async with sim_client() as c:
        body = chat_body(model=None, min_tokens=40)
        del body["max_tokens"]
        r = await c.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 40
        body = completion_body(model=None, min_tokens=40)
        del body["max_tokens"]
        r = await c.post(COMPLETIONS, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "min_tokens must be less than or equal to max_tokens=16, got 40."


async def test_the_context_limit_as_vllm_0_32_applies_it() -> None:
    """vLLM 0.32 (its renderer and get_max_tokens): a prompt over the context is refused (a text
    prompt is counted up to one token past it: "at least"); one that fills it leaves max_tokens 0;
    a prompt that fits with a ``max_tokens`` that does not is served, cut to the context left (the
    simulator used to refuse it in an older vLLM's words); ``max_tokens`` over the context is refused."""
    limit = 64
    async with sim_client(max_model_len=limit) as c:
        async def err(route: str, body: dict[str, Any]) -> dict[str, Any]:
            r = await c.post(route, json=body)
            assert r.status_code == 400, r.text
            return dict(r.json()["error"])

        e = await err(COMPLETIONS, {"prompt": "w " * 100, "max_tokens": 2})
        assert e["message"] == ("This model's maximum context length is 64 tokens. However, your prompt contains "
                                "at least 65 input tokens, which exceeds this limit even without any output tokens. "
                                "Please reduce the length of the input prompt. (parameter=input_tokens, value=65)")
        assert e["param"] == "input_tokens"
        e = await err(COMPLETIONS, {"prompt": list(range(1, 71)), "max_tokens": 2})
        assert "your prompt contains 70 input tokens" in e["message"]
        e = await err(COMPLETIONS, {"prompt": list(range(1, limit + 1)), "max_tokens": 2})
        assert (e["message"], e["param"]) == ("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                                              "max_tokens")
        e = await err(CHAT, chat_body(model=None, max_completion_tokens=65))
        assert e["param"] == "max_completion_tokens" and "cannot be greater than max_model_len=64" in e["message"]
        r = await c.post(COMPLETIONS, json={"prompt": list(range(1, 61)), "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == limit - 60


async def test_truncate_prompt_tokens_as_vllm_0_32_applies_it() -> None:
    """vLLM 0.32 (renderers/params.py, checked on the real engine): ``truncate_prompt_tokens`` keeps
    the prompt's last tokens (its first with ``truncation_side: right``) before the context is
    checked; -1 keeps the context less one; one past the context is refused."""
    limit = 64
    ids = list(range(1, 101))
    async with sim_client(max_model_len=limit) as c:
        async def served(route: str, body: dict[str, Any]) -> dict[str, Any]:
            r = await c.post(route, json={"max_tokens": 1, "return_token_ids": True, **body})
            assert r.status_code == 200, r.text
            return dict(r.json())

        out = await served(COMPLETIONS, {"prompt": ids, "truncate_prompt_tokens": 10})
        assert out["choices"][0]["prompt_token_ids"] == ids[-10:] and out["usage"]["prompt_tokens"] == 10
        out = await served(COMPLETIONS, {"prompt": ids, "truncate_prompt_tokens": 10, "truncation_side": "right"})
        assert out["choices"][0]["prompt_token_ids"] == ids[:10]
        out = await served(COMPLETIONS, {"prompt": ids, "truncate_prompt_tokens": -1})
        assert out["choices"][0]["prompt_token_ids"] == ids[-(limit - 1):]
        out = await served(COMPLETIONS, {"prompt": ids[:5], "truncate_prompt_tokens": 10})
        assert out["choices"][0]["prompt_token_ids"] == ids[:5]  # shorter: kept whole
        out = await served(CHAT, {**chat_body(model=None, messages=[{"role": "user", "content": "w " * 200}]),
                                  "truncate_prompt_tokens": 20})
        assert out["usage"]["prompt_tokens"] == 20
        r = await c.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": limit + 1})
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert (e["message"], e["param"]) == (
            "truncate_prompt_tokens=65 cannot be greater than max_model_len = 64. Please request a smaller truncation "
            "size. (parameter=truncate_prompt_tokens, value=65)", "truncate_prompt_tokens")
        r = await c.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["message"] == "The decoder prompt cannot be empty"
        assert r.json()["error"]["param"] is None


async def test_a_truncated_prompts_continuation_generates_exactly_the_rest() -> None:
    """(Found reading the resume path.) The continuation of an answer whose prompt the engine
    truncated carries the prompt the engine ran: were ``truncate_prompt_tokens`` sent again, the
    engine would cut that prompt plus the output so far, and the rest would follow another context."""
    from narwhal_serve.protocol.requests import parse_request
    from narwhal_serve.relay.resume import continuation_body

    body = {"model": "tiny", "prompt": list(range(1, 101)), "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "truncate_prompt_tokens": 10, "return_token_ids": True}
    async with sim_client(model="tiny", max_model_len=64) as c:
        whole = (await c.post(COMPLETIONS, json=body)).json()["choices"][0]
        ran, out = whole["prompt_token_ids"], whole["token_ids"]
        assert ran == list(range(91, 101)) and len(out) == 12
        req = parse_request("completion", json.dumps(body).encode(), model="tiny")
        cont = continuation_body(req, ran, out[:5])
        assert cont is not None and "truncate_prompt_tokens" not in cont
        rest = parse_sse((await c.post(COMPLETIONS, json=cont)).text)
    assert [t for ev in rest if isinstance(ev, dict) for ch in ev.get("choices") or () for t in ch.get("token_ids") or ()] \
        == out[5:]


async def test_fields_the_router_passes_on_are_judged_as_vllm_0_32_judges_them() -> None:
    """(Found by a hostile probe: a simulated fleet served what a vLLM fleet refuses.) ``logit_bias``
    keys that are not token IDs (SamplingParams.from_optional), a seed past 64 bits (the schema),
    ``tool_choice`` without ``tools`` or not one vLLM names, an empty ``tools`` (check_tool_usage);
    a chat's ``max_tokens`` beside ``max_completion_tokens`` is not read."""
    async with sim_client() as c:
        async def refused(route: str, extra: dict[str, Any]) -> dict[str, Any]:
            body = chat_body(model=None) if route == CHAT else {"prompt": "hi"}
            r = await c.post(route, json={**body, "max_tokens": 2, **extra})
            assert r.status_code == 400, (extra, r.text)
            return dict(r.json()["error"])

        e = await refused(COMPLETIONS, {"logit_bias": {"abc": 1, "7": 2}})
        assert e["param"] == "logit_bias" and "cannot be converted to integer token IDs: ['abc']" in e["message"]
        assert (await refused(COMPLETIONS, {"logit_bias": {"1": "x"}}))
        assert (await refused(COMPLETIONS, {"seed": 2**63}))
        e = await refused(CHAT, {"tool_choice": "required"})
        assert e["param"] == "tool_choice" and e["message"].startswith("When using `tool_choice`, `tools` must be set.")
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert (await refused(CHAT, {"tools": tools, "tool_choice": "bogus"}))["param"] == "tool_choice"
        assert (await refused(CHAT, {"tools": []}))["param"] == "tools"
        for route, extra in ((COMPLETIONS, {"logit_bias": {"7": -1.5}, "seed": 2**63 - 1}),
                             (CHAT, {"tool_choice": "none"}),
                             (CHAT, {"max_completion_tokens": 2, "max_tokens": 0})):
            body = chat_body(model=None) if route == CHAT else {"prompt": "hi"}
            r = await c.post(route, json={**body, "max_tokens": 2, **extra})
            assert r.status_code == 200, (extra, r.text)
