"""Mid-stream resume over httpx.MockTransport engines (docs/contract.md, "Engine failures"): an answer cut after
its first token continues on the other engine from the prompt and output token IDs, re-shaped into
the client's route, with no token lost or repeated; what cannot be exact ends as before."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from narwhal_serve.config import EngineConfig
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from tests.support.sse import parse_sse
from tests.support.relay import faults_of, health_order

E1 = EngineConfig(name="e1", url="http://e1")
E2 = EngineConfig(name="e2", url="http://e2")
PROMPT = [7, 8, 9]


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chat_tok(text: str, tid: int, finish: str | None = None, lp: Any = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": finish,
                         "stop_reason": None, "token_ids": [tid]}]}


CHAT_ROLE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
             "prompt_token_ids": PROMPT,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def cmpl_tok(text: str, tid: int, finish: str | None = None, first: bool = False, stop: str | None = None,
             lp: Any = None) -> dict[str, Any]:
    return {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop,
                         "token_ids": [tid], "prompt_token_ids": None}]}


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


class Parts(httpx.AsyncByteStream):
    """A body in several reads, a moment apart; ``broken``: the connection then drops."""

    def __init__(self, *parts: bytes, broken: bool = False) -> None:
        self.parts, self.broken = parts, broken

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for i, p in enumerate(self.parts):
            if i:
                await asyncio.sleep(0.02)
            yield p
        if self.broken:
            raise httpx.ReadError("connection reset")


def placed(route: str = "chat", stream: bool = True, **body: Any) -> PlacedRequest:
    base: dict[str, Any] = {"model": "m", "stream": stream, "max_tokens": 5}
    if route == "chat":
        base["messages"] = [{"role": "user", "content": "q"}]
    else:
        base["prompt"] = "q"
    req = parse_request(route, json.dumps({**base, **body}).encode(), model="m")  # type: ignore[arg-type]
    return PlacedRequest("rid-1", "m", req, (RouteChoice("single", E1), RouteChoice("single", E2)), time.time() + 30)


class Engines:
    """e1 answers the client's request and dies after two tokens; e2 answers the continuation."""

    def __init__(self, first: bytes, cont: Callable[[dict[str, Any]], httpx.Response], broken: bool = True) -> None:
        self.first, self.cont, self.broken = first, cont, broken
        self.bodies: list[tuple[str, str, dict[str, Any]]] = []

    def __call__(self, r: httpx.Request) -> httpx.Response:
        body = json.loads(r.content)
        self.bodies.append((r.url.host, r.url.path, body))
        if r.url.host == "e1":
            return httpx.Response(200, stream=Parts(self.first, broken=self.broken))
        return self.cont(body)


async def run(engines: Engines, p: PlacedRequest, **relay: Any) -> list[RelayMessage]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as client:
        return [m async for m in Relay(client, **relay).run(p)]


def events(msgs: list[RelayMessage]) -> list[Any]:
    return parse_sse(b"".join(m.data for m in msgs).decode())


def ids_of(evs: list[Any]) -> list[int]:
    return [i for e in evs if isinstance(e, dict) for c in e.get("choices") or () for i in c.get("token_ids") or ()]


FIRST_TWO = sse(CHAT_ROLE, chat_tok("a", 1), chat_tok("b", 2), done=False)


def continuation(*chunks: dict[str, Any]) -> Callable[[dict[str, Any]], httpx.Response]:
    return lambda body: httpx.Response(200, stream=httpx.ByteStream(sse(*chunks)))


CONT = continuation(cmpl_tok("c", 3), cmpl_tok("d", 4), cmpl_tok("e", 5, "length"), usage(5, 3))


async def test_a_stream_cut_after_two_tokens_continues_on_the_other_engine_as_chat_deltas() -> None:
    eng = Engines(FIRST_TWO, CONT)
    msgs = await run(eng, placed(return_token_ids=True, stream_options={"include_usage": True}, temperature=0))
    host, path, body = eng.bodies[-1]
    assert (host, path) == ("e2", "/v1/completions")
    assert body["prompt"] == [*PROMPT, 1, 2] and body["max_tokens"] == 3 and body["temperature"] == 0
    assert "messages" not in body and body["stream"] and body["return_token_ids"]
    evs = events(msgs)
    assert evs[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in evs)
    assert ids_of(evs) == [1, 2, 3, 4, 5]
    chunks = [e for e in evs if isinstance(e, dict) and e.get("choices")]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" and c["created"] == 5 for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "abcde"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    [u] = [e["usage"] for e in evs if isinstance(e, dict) and e.get("usage")]
    assert u == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    moved = [m for m in msgs if m.moved]
    assert len(moved) == 1 and moved[0].engines == ("e2",)
    assert [r for m in msgs for r in m.resumes] == [("reset", "resumed")]
    assert [f.engine for m in msgs for f in faults_of(m)] == ["e1"]
    # the breakers hear it in order: e1 produced a first token, then failed; e2 took over
    assert health_order(msgs) == [("e1",), "e1", ("e2",)]
    stats = msgs[-1].stats
    assert stats is not None and stats.output_tokens == 5 and stats.resumed_from == ("e1",)
    assert stats.engines == ("e2",) and len(stats.resume_gap_s) == 1 and stats.resume_gap_s[0] >= 0


@pytest.mark.parametrize("stream", [True, False])
async def test_an_error_event_in_the_same_read_as_the_first_tokens_is_resumed_after_them(stream: bool) -> None:
    """vLLM's in-stream error event arriving in one network read with the tokens before it: those
    tokens count (the client gets them, e1 is credited a first token) and the answer is resumed."""
    err = {"error": {"object": "error", "message": "engine died", "type": "InternalServerError", "code": 500}}
    eng = Engines(sse(CHAT_ROLE, chat_tok("a", 1), chat_tok("b", 2), err), CONT, broken=False)
    msgs = await run(eng, placed(stream=stream, return_token_ids=True, temperature=0))
    assert eng.bodies[-1][2]["prompt"] == [*PROMPT, 1, 2]
    assert [r for m in msgs for r in m.resumes] == [("engine_error", "resumed")]
    assert health_order(msgs) == [("e1",), "e1", ("e2",)]
    if stream:
        assert ids_of(events(msgs)) == [1, 2, 3, 4, 5]
    else:
        assert json.loads(msgs[-1].data)["choices"][0]["token_ids"] == [1, 2, 3, 4, 5]


async def test_a_non_streaming_answer_cut_mid_way_is_assembled_from_both_engines() -> None:
    eng = Engines(FIRST_TWO, CONT)
    msgs = await run(eng, placed(stream=False, return_token_ids=True))
    assert [h for h, _, _ in eng.bodies] == ["e1", "e2"]  # continued, not generated again
    out = json.loads(msgs[-1].data)
    assert out["choices"][0]["message"]["content"] == "abcde" and out["choices"][0]["token_ids"] == [1, 2, 3, 4, 5]
    assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 5
    assert out["id"] == "chatcmpl-1" and out["object"] == "chat.completion"


async def test_completions_keep_their_shape_and_text_offsets_continue() -> None:
    lp1 = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": ["a"], "top_logprobs": [{"a": -0.5}]}
    first = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
             "choices": [{"index": 0, "text": "aa", "logprobs": lp1, "finish_reason": None, "stop_reason": None,
                          "token_ids": [1], "prompt_token_ids": PROMPT}]}
    # the continuation engine's offsets count from its own first character, across its chunks (as vLLM's)
    lp2 = {"text_offset": [0], "token_logprobs": [-0.1], "tokens": ["c"], "top_logprobs": [{"c": -0.1}]}
    lp3 = {"text_offset": [1], "token_logprobs": [-0.2], "tokens": ["dd"], "top_logprobs": [{"dd": -0.2}]}
    lp4 = {"text_offset": [3], "token_logprobs": [-0.3], "tokens": ["e"], "top_logprobs": [{"e": -0.3}]}
    eng = Engines(sse(first, done=False), continuation(cmpl_tok("c", 3, lp=lp2), cmpl_tok("dd", 4, lp=lp3),
                                                       cmpl_tok("e", 5, "length", lp=lp4)))
    msgs = await run(eng, placed("completion", return_token_ids=True, logprobs=1, max_tokens=4))
    assert eng.bodies[-1][2]["logprobs"] == 1 and eng.bodies[-1][2]["max_tokens"] == 3
    evs = [e for e in events(msgs) if isinstance(e, dict)]
    assert ids_of(evs) == [1, 3, 4, 5]
    cont = [e["choices"][0] for e in evs if e.get("choices") and e["choices"][0].get("token_ids") != [1]]
    assert [c["text"] for c in cont] == ["c", "dd", "e"]
    assert [c["logprobs"]["text_offset"] for c in cont] == [[2], [3], [5]]  # "aa" + "c" + "dd" before "e"
    last = evs[-1]["choices"][0]
    assert evs[-1]["id"] == "cmpl-1" and last["text"] == "e"
    assert last.get("prompt_token_ids") is None  # the client got them once, with the first chunk


async def test_chat_logprobs_of_the_continuation_come_in_chat_shape() -> None:
    # (the sampled token's only: chat's top logprobs are not resumed, below)
    lp = {"text_offset": [0], "token_logprobs": [-0.25], "tokens": ["c"], "top_logprobs": [{"c": -0.25}]}
    eng = Engines(FIRST_TWO, continuation(cmpl_tok("c", 3, "length", lp=lp)))
    msgs = await run(eng, placed(logprobs=True, max_tokens=3))
    assert eng.bodies[-1][2]["logprobs"] == 0 and "top_logprobs" not in eng.bodies[-1][2]
    last = [e for e in events(msgs) if isinstance(e, dict) and e.get("choices")][-1]["choices"][0]
    [entry] = last["logprobs"]["content"]
    assert entry["token"] == "c" and entry["logprob"] == -0.25 and entry["bytes"] == [99]
    assert entry["top_logprobs"] == []


@pytest.mark.parametrize(("body", "why"), [
    ({"stop": ["zz"]}, "stop strings held back"),
    # one may straddle the cut, and vLLM trims the tokens after it (several in a chunk): not resumed
    ({"stop": ["bc"], "include_stop_str_in_output": True}, "stop strings"),
    ({"logprobs": True, "top_logprobs": 2}, "chat top logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool calls"),
    ({"response_format": {"type": "json_object"}}, "structured output"),
    ({"frequency_penalty": 0.5}, "frequency penalty"),
])
async def test_what_cannot_be_exact_ends_with_the_error_event(body: dict[str, Any], why: str) -> None:
    eng = Engines(FIRST_TWO, CONT)
    msgs = await run(eng, placed(**body))
    assert [h for h, _, _ in eng.bodies] == ["e1"]
    assert msgs[-1].error is not None and msgs[-1].data.endswith(b"data: [DONE]\n\n")
    assert [r for m in msgs for r in m.resumes] == [("reset", "not_exact")]


async def test_without_the_prompt_token_ids_nothing_is_resumed() -> None:
    role = {**CHAT_ROLE}
    del role["prompt_token_ids"]
    eng = Engines(sse(role, chat_tok("a", 1), done=False), CONT)
    msgs = await run(eng, placed())
    assert msgs[-1].error is not None and [r for m in msgs for r in m.resumes] == [("reset", "not_exact")]


async def test_max_resumes_zero_turns_it_off() -> None:
    eng = Engines(FIRST_TWO, CONT)
    msgs = await run(eng, placed(), max_resumes=0)
    assert msgs[-1].error is not None and [r for m in msgs for r in m.resumes] == [("reset", "limit")]


async def test_a_continuation_that_fails_before_its_first_token_ends_the_stream_with_the_error_event() -> None:
    eng = Engines(FIRST_TWO, lambda body: httpx.Response(500, json={"error": {"message": "boom"}}))
    msgs = await run(eng, placed())
    assert msgs[-1].error is not None and msgs[-1].data.endswith(b"data: [DONE]\n\n")
    assert [r for m in msgs for r in m.resumes] == [("reset", "failed")]
    assert sorted(f.engine for m in msgs for f in faults_of(m)) == ["e1", "e2"]


async def test_a_continuation_on_the_wrong_prompt_is_refused_before_anything_is_written() -> None:
    wrong = {**cmpl_tok("c", 3), "choices": [{**cmpl_tok("c", 3)["choices"][0], "prompt_token_ids": [1]}]}
    eng = Engines(FIRST_TWO, continuation(wrong, cmpl_tok("d", 4, "length")))
    msgs = await run(eng, placed(return_token_ids=True))
    assert ids_of(events(msgs)) == [1, 2] and msgs[-1].error is not None


async def test_a_cut_after_the_finish_reason_only_lost_the_end() -> None:
    eng = Engines(sse(CHAT_ROLE, chat_tok("a", 1), chat_tok("b", 2, "stop"), done=False), CONT)
    msgs = await run(eng, placed(stream_options={"include_usage": True}))
    evs = events(msgs)
    assert [h for h, _, _ in eng.bodies] == ["e1"] and evs[-1] == "[DONE]" and msgs[-1].error is None
    [u] = [e["usage"] for e in evs if isinstance(e, dict) and e.get("usage")]
    assert u["completion_tokens"] == 2 and u["prompt_tokens"] == 3
    assert [r for m in msgs for r in m.resumes] == [("reset", "finished")]


async def test_a_cut_at_max_tokens_ends_with_finish_reason_length() -> None:
    eng = Engines(FIRST_TWO, CONT)
    msgs = await run(eng, placed(max_tokens=2))
    chunks = [e for e in events(msgs) if isinstance(e, dict) and e.get("choices")]
    assert [h for h, _, _ in eng.bodies] == ["e1"] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert msgs[-1].error is None and [r for m in msgs for r in m.resumes] == [("reset", "finished")]


async def test_a_stall_mid_stream_is_resumed_after_the_idle_timeout() -> None:
    class Stall(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[no-untyped-def]
            yield FIRST_TWO
            await asyncio.Event().wait()

    def h(r: httpx.Request) -> httpx.Response:
        if r.url.host == "e1":
            return httpx.Response(200, stream=Stall())
        return CONT(json.loads(r.content))

    async with httpx.AsyncClient(transport=httpx.MockTransport(h)) as client:
        msgs = [m async for m in Relay(client, idle_timeout_s=0.2).run(placed(return_token_ids=True))]
    assert ids_of(events(msgs)) == [1, 2, 3, 4, 5] and msgs[-1].error is None
    assert [r for m in msgs for r in m.resumes] == [("stall", "resumed")]


async def test_a_non_streaming_answer_whose_continuation_fails_is_a_502_without_a_third_try() -> None:
    eng = Engines(FIRST_TWO, lambda body: httpx.Response(500, json={"error": {"message": "boom"}}))
    msgs = await run(eng, placed(stream=False))
    assert [h for h, _, _ in eng.bodies] == ["e1", "e2"]  # e2 failed the continuation: not tried again
    assert msgs[-1].error is not None and msgs[-1].error.status == 502
    assert [r for m in msgs for r in m.resumes] == [("reset", "failed")]
    assert sorted(f.engine for m in msgs for f in faults_of(m)) == ["e1", "e2"]


async def test_the_continuation_goes_to_the_least_loaded_engine_eligible_now_not_only_to_a_candidate() -> None:
    e3 = EngineConfig(name="e3", url="http://e3")
    seen: list[str] = []

    def h(r: httpx.Request) -> httpx.Response:
        seen.append(r.url.host)
        if r.url.host == "e1":
            return httpx.Response(200, stream=Parts(FIRST_TWO, broken=True))
        return CONT(json.loads(r.content))

    async with httpx.AsyncClient(transport=httpx.MockTransport(h)) as client:
        relay = Relay(client)
        relay.live_targets = lambda _tokens: [E1, e3, E2]  # e1 failed this request: skipped
        msgs = [m async for m in relay.run(placed(return_token_ids=True))]
    assert seen == ["e1", "e3"] and ids_of(events(msgs)) == [1, 2, 3, 4, 5]
    assert [m.engines for m in msgs if m.moved] == [("e3",)]


def test_resume_targets_are_every_client_facing_engine_least_loaded_first() -> None:
    from narwhal_serve.placement.picker import resume_targets
    from tests.unit.core.test_scheduler_service import service

    svc, _ = service()
    names = [e.name for e in resume_targets(list(svc.engines.values()))]
    assert sorted(names) == sorted(n for n, e in svc.engines.items() if e.cfg.role != "prefill")
    busiest = names[0]
    svc.engines[busiest].inflight = 5
    assert resume_targets(list(svc.engines.values()))[-1].name == busiest


async def test_a_pd_decode_engine_dying_mid_answer_is_continued_on_a_unified_engine() -> None:
    p1 = EngineConfig(name="p1", url="http://p1", role="prefill")
    d1 = EngineConfig(name="d1", url="http://d1", role="decode")
    seen: list[str] = []

    def h(r: httpx.Request) -> httpx.Response:
        seen.append(r.url.host)
        if r.url.host == "p1":
            return httpx.Response(200, json={"id": "x", "choices": [], "kv_transfer_params": {"remote_engine_id": "p1"}})
        if r.url.host == "d1":
            return httpx.Response(200, stream=Parts(FIRST_TWO, broken=True))
        return CONT(json.loads(r.content))

    p = placed(return_token_ids=True)
    p = PlacedRequest(p.request_id, p.model, p.request, (RouteChoice("pd", d1, p1), RouteChoice("single", E2)),
                      p.deadline)
    async with httpx.AsyncClient(transport=httpx.MockTransport(h)) as client:
        msgs = [m async for m in Relay(client).run(p)]
    assert seen == ["p1", "d1", "e2"] and ids_of(events(msgs)) == [1, 2, 3, 4, 5]
    assert msgs[-1].stats is not None and msgs[-1].stats.resumed_from == ("d1",) and msgs[-1].stats.engines == ("e2",)


async def test_a_second_cut_continues_after_exactly_what_the_client_got() -> None:
    e3 = EngineConfig(name="e3", url="http://e3")
    bad = cmpl_tok("x", 9)
    bad["choices"][0]["token_ids"] = [-1]
    bodies: dict[str, dict[str, Any]] = {}

    def h(r: httpx.Request) -> httpx.Response:
        bodies[r.url.host] = json.loads(r.content)
        if r.url.host == "e1":
            return httpx.Response(200, stream=Parts(FIRST_TWO, broken=True))
        if r.url.host == "e2":  # one good token, then a bad one in the same read
            return httpx.Response(200, stream=httpx.ByteStream(sse(cmpl_tok("c", 3), bad, done=False)))
        return httpx.Response(200, stream=httpx.ByteStream(sse(cmpl_tok("d", 4), cmpl_tok("e", 5, "length"))))

    async with httpx.AsyncClient(transport=httpx.MockTransport(h)) as client:
        relay = Relay(client, max_resumes=2)
        relay.live_targets = lambda _tokens: [E2, e3]
        msgs = [m async for m in relay.run(placed(return_token_ids=True))]
    assert bodies["e3"]["prompt"] == [*PROMPT, 1, 2, 3] and bodies["e3"]["max_tokens"] == 2
    assert ids_of(events(msgs)) == [1, 2, 3, 4, 5] and msgs[-1].error is None
    assert [r for m in msgs for r in m.resumes] == [("reset", "resumed"), ("bad_response", "resumed")]


async def test_usage_on_every_chunk_continues_after_the_cut_counting_one_answer() -> None:
    """``stream_options.continuous_usage_stats``: the continuation is asked for it too, and its
    per-chunk usage counts the original prompt once and every output token so far."""
    def tok(text: str, tid: int, done: int, finish: str | None = None) -> dict[str, Any]:
        return {**cmpl_tok(text, tid, finish), "usage": {"prompt_tokens": 5, "completion_tokens": done,
                                                         "total_tokens": 5 + done}}

    first = sse({**CHAT_ROLE, "usage": usage(3, 0)["usage"]},
                {**chat_tok("a", 1), "usage": usage(3, 1)["usage"]}, {**chat_tok("b", 2), "usage": usage(3, 2)["usage"]},
                done=False)
    eng = Engines(first, continuation(tok("c", 3, 1), tok("d", 4, 2), tok("e", 5, 3, "length"), usage(5, 3)))
    msgs = await run(eng, placed(return_token_ids=True, temperature=0,
                                 stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert eng.bodies[-1][2]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    evs = events(msgs)
    assert ids_of(evs) == [1, 2, 3, 4, 5] and msgs[-1].error is None
    counted = [e["usage"]["completion_tokens"] for e in evs if isinstance(e, dict) and e.get("choices")
               and e["choices"][0].get("token_ids")]
    assert counted == [1, 2, 3, 4, 5]  # one answer's count, through the cut
    assert all(e["usage"]["prompt_tokens"] == 3 for e in evs if isinstance(e, dict) and e.get("usage"))


def test_a_continuation_without_a_client_limit_keeps_the_engines_own() -> None:
    """(Found by a hostile probe.) The continuation goes to the completions endpoint, whose
    ``max_tokens`` defaults to 16 on vLLM, and vLLM 0.32 turns a null into that default too
    (normalize_null_max_tokens); a chat sent without a limit runs up to the context, so its
    continuation asks for the room the target engine's context leaves after its prompt.
    (Found by a review.) A completion sent without one, or with null, ended at 16 tokens on its
    engine: its continuation asks for what is left of 16.  With a limit, what is left of it."""
    from narwhal_serve.relay.resume import continuation_body
    for route, body, want in (
            ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, 4096 - 5),
            ("completion", {"model": "m", "prompt": "hi"}, 13),
            ("completion", {"model": "m", "prompt": "hi", "max_tokens": None}, 13)):
        req = parse_request(route, json.dumps(body).encode(), model="m")  # type: ignore[arg-type]
        out = continuation_body(req, [1, 2], [3, 4, 5], context=4096)
        assert out is not None and "max_tokens" in out and out["max_tokens"] == want, (route, body, out)
        assert json.loads(json.dumps(out))["max_tokens"] == want
    req = parse_request("completion", json.dumps({"model": "m", "prompt": "hi"}).encode(), model="m")
    assert continuation_body(req, [1], list(range(16))) is None  # its 16 were all sent before the cut
    req = parse_request("chat", json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "max_completion_tokens": 10}).encode(), model="m")
    assert (continuation_body(req, [1], [2, 3]) or {})["max_tokens"] == 8


def vllm_like_end(body: dict[str, Any]) -> httpx.Response:
    """A continuation ending as vLLM 0.32 ends a stream: ``system_fingerprint`` on the usage-only
    chunk when usage was asked for, else on the finish chunk."""
    asked = (body.get("stream_options") or {}).get("include_usage")
    last = cmpl_tok("e", 5, "length") if asked else {**cmpl_tok("e", 5, "length"), "system_fingerprint": "fp-e2"}
    tail = (({**usage(5, 3), "system_fingerprint": "fp-e2"},) if asked else ())
    return httpx.Response(200, stream=httpx.ByteStream(sse(cmpl_tok("c", 3), cmpl_tok("d", 4), last, *tail)))


@pytest.mark.parametrize("client", ["stream", "stream_usage", "non_stream"])
async def test_the_fingerprint_sent_only_at_the_end_still_reaches_a_resumed_answer(client: str) -> None:
    """vLLM puts ``system_fingerprint`` on its last chunk only (the usage-only one when usage was
    asked for): an answer cut before it gets the continuation engine's.  A streaming client that did
    not ask for usage got none (the continuation asked for usage, and the relay drops that chunk for
    this client): the continuation now asks only when usage is read.  The first engine's, when it
    came, wins."""
    body: dict[str, Any] = {"stream": client != "non_stream", "return_token_ids": True}
    if client == "stream_usage":
        body["stream_options"] = {"include_usage": True}
    eng = Engines(FIRST_TWO, vllm_like_end)
    msgs = await run(eng, placed(**body))
    asked = (eng.bodies[-1][2].get("stream_options") or {}).get("include_usage")
    assert asked is (True if client != "stream" else None)
    if client == "non_stream":
        assert json.loads(msgs[-1].data)["system_fingerprint"] == "fp-e2"
    else:
        evs = [e for e in events(msgs) if isinstance(e, dict)]
        assert ids_of(evs) == [1, 2, 3, 4, 5] and msgs[-1].error is None
        assert evs[-1].get("system_fingerprint") == "fp-e2", evs[-1]
        assert {e.get("system_fingerprint") for e in evs[:-1]} == {None}
        assert ("usage" in evs[-1]) is (client == "stream_usage")
    first = sse({**CHAT_ROLE, "system_fingerprint": "fp-e1"}, chat_tok("a", 1), chat_tok("b", 2), done=False)
    msgs = await run(Engines(first, vllm_like_end), placed(return_token_ids=True))
    fps = {e.get("system_fingerprint") for e in events(msgs) if isinstance(e, dict) and e.get("choices")}
    assert fps - {None} == {"fp-e1"}
