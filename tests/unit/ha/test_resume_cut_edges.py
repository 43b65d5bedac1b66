"""Mid-stream resume at its edges, each found by a read-only review of the relay (every test failed
before its fix): a chat without a limit on a real vLLM's completions endpoint, a cut inside a
character that arrived in a chunk of several tokens, a continuation the engine refuses, an engine
that dies after its last token, and a deadline that overtakes a continuation's prefill."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import httpx

from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from tests.support.relay import faults_of
from tests.unit.core import test_resume as r
from tests.unit.ha import test_resume_vllm_semantics as v

CTX = 64  # the continuation engine's context


def vllm_context(cont: Any) -> Any:
    """A continuation engine that checks a completion's prompt as vLLM's completions endpoint does in
    the versions before 0.32 that have its renderer (vllm/renderers/params.py, ``TokenizeParams``:
    at most ``max_model_len - max_tokens`` prompt tokens, else a 400; 0.32 cuts ``max_tokens`` to
    the room instead, where the room asked for is what it serves too:
    tests/e2e/test_vllm_resume.py)."""
    def answer(body: dict[str, Any]) -> list[dict[str, Any]]:
        n, limit = len(body["prompt"]), v.vllm_completion_limit(body)
        if limit > CTX or n > CTX - limit:
            raise Refused(f"You passed {n} input tokens and requested {limit} output tokens. However, the "
                          f"model's context length is only {CTX} tokens")
        out: list[dict[str, Any]] = cont(body)
        return out
    return answer


class Refused(Exception):
    pass


class Checked(v.Engines):
    def __call__(self, req: httpx.Request) -> httpx.Response:
        try:
            return super().__call__(req)
        except Refused as exc:
            return httpx.Response(400, json={"error": {"message": str(exc), "type": "BadRequestError", "code": 400}})


async def relay_run(eng: Any, p: Any, **attrs: Any) -> list[RelayMessage]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(eng)) as client:
        relay = Relay(client)
        for k, val in attrs.items():
            setattr(relay, k, val)
        return [m async for m in relay.run(p)]


def resumes(msgs: list[RelayMessage]) -> list[tuple[str, str]]:
    return [x for m in msgs for x in m.resumes]


def faults(msgs: list[RelayMessage]) -> list[tuple[str, str]]:
    return [(f.engine, f.kind) for m in msgs for f in faults_of(m)]


async def test_a_chat_without_a_limit_asks_for_the_room_its_context_leaves() -> None:
    """It asked for the whole context as ``max_tokens``, which vLLM versions before 0.32 refuse with
    any prompt (they leave ``context - max_tokens`` tokens for the prompt): there such a chat was
    never resumed (streaming: the error event; non-streaming: a 400 blaming the client).  Now the
    room left after the prompt and the output so far, as vLLM's own limit for the chat was."""
    for p in (v.chat(return_token_ids=True), v.chat(return_token_ids=True, stream=False)):
        eng = Checked(v.FIRST_AB, vllm_context(v.model_answer(20)))
        msgs = await relay_run(eng, p, live_context={"e2": CTX}.get)
        assert eng.hosts == ["e1", "e2"] and eng.bodies[-1][1]["max_tokens"] == CTX - len(v.PROMPT) - 2
        assert resumes(msgs) == [("reset", "resumed")] and msgs[-1].error is None, (resumes(msgs), msgs[-1].error)
    # a context already full: the engine would have ended there; nothing is sent, the answer ends
    # with "length", and the dead engine's fault still reaches its breaker
    eng = Checked(v.FIRST_AB, vllm_context(v.model_answer(20)))
    msgs = await relay_run(eng, v.chat(return_token_ids=True), live_context={"e2": len(v.PROMPT) + 2}.get)
    assert eng.hosts == ["e1"] and v.finish_of(msgs)[0] == "length" and msgs[-1].error is None
    assert resumes(msgs) == [("reset", "finished")] and faults(msgs) == [("e1", "error")]


# e1 sends "a" and the first byte of "é" (token 134) in one chunk, as vLLM does when it merges the
# steps its output reader fell behind on: the byte's text is held back, so the chunk's text is "a"
MERGED = v.sse(v.cmpl("a", [1, 134], first=True), done=False)
BYTES = {1: b"a", 134: b"\xc3", 109: b"\xa9", 5: b" ok"}


def decode(ids: list[int]) -> str:
    return b"".join(BYTES.get(i, b"?") for i in ids).decode("utf-8", errors="replace")


def char_cont(body: dict[str, Any]) -> list[dict[str, Any]]:
    """vLLM started on a prompt that ends mid-character writes the prompt's text again ("q") with
    it; started before the character, it generates its bytes anew."""
    if body["prompt"][-1] == 134:
        return [v.cmpl("qaé", [109]), v.cmpl(" ok", [5], "length")]
    return [v.cmpl("", [134]), v.cmpl("é", [109]), v.cmpl(" ok", [5], "length")]


async def test_a_cut_inside_a_character_sent_with_other_tokens_is_found_by_the_tokenizer() -> None:
    """The character's first byte came in a chunk with text, so it was not counted as held back,
    and the continuation started mid-character: the client got the prompt's text ("q") inside its
    answer.  With the model's tokenizer the relay finds where the character starts; without one it
    does not resume (the error event, ``not_exact``) rather than guess."""
    eng = v.Engines(MERGED, char_cont)
    msgs = await relay_run(eng, v.completion(max_tokens=4, return_token_ids=True), detokenize=decode)
    assert eng.bodies[-1][1]["prompt"] == [*v.PROMPT, 1]
    assert v.text_of(msgs) == "aé ok" and v.ids_of(msgs) == [1, 134, 109, 5], (v.text_of(msgs), v.ids_of(msgs))
    eng = v.Engines(MERGED, char_cont)
    msgs = await relay_run(eng, v.completion(max_tokens=4, return_token_ids=True))
    assert eng.hosts == ["e1"] and resumes(msgs) == [("reset", "not_exact")] and msgs[-1].error is not None
    assert "q" not in v.text_of(msgs)
    # a merged chunk that ends on whole characters resumes as before, with or without the tokenizer
    whole = v.sse(v.cmpl("a", [1, 1], first=True), done=False)
    for attrs in ({"detokenize": decode}, {}):
        eng = v.Engines(whole, lambda body: [v.cmpl(" ok", [5], "length")])
        msgs = await relay_run(eng, v.completion(max_tokens=3, return_token_ids=True), **attrs)
        if attrs:
            assert eng.bodies[-1][1]["prompt"] == [*v.PROMPT, 1, 1] and v.text_of(msgs) == "a ok"
        else:
            assert resumes(msgs) == [("reset", "not_exact")]


def refusing(body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 8 tokens",
                                               "type": "BadRequestError", "code": 400}})


async def test_a_refused_continuation_is_the_routers_failure_not_the_clients() -> None:
    """A continuation the target refuses with a 4xx (its context or ``--max-logprobs`` smaller
    than the first engine's): a non-streaming client got a 400 "The engine rejected the request"
    and the request counted as invalid; a streaming one's error charged the healthy target's
    breaker.  Now neither: the next route is tried for the non-streaming answer, and the fault
    reported is the dead engine's only."""
    eng = r.Engines(r.FIRST_TWO, refusing)
    msgs = await r.run(eng, r.placed(stream=False))
    err = msgs[-1].error
    assert err is not None and err.status != 400 and err.code != "invalid_request", err
    assert faults(msgs) == [("e1", "error")]
    eng = r.Engines(r.FIRST_TWO, refusing)
    msgs = await r.run(eng, r.placed(stream=True))
    assert msgs[-1].error is not None and faults(msgs) == [("e1", "error")]


async def test_an_engine_dying_after_its_last_token_is_reported() -> None:
    """The answer is whole (only ``[DONE]`` was lost), but the engine failed: its breaker hears of it."""
    done = r.sse(r.CHAT_ROLE, r.chat_tok("a", 1), r.chat_tok("b", 2, "stop"), done=False)
    eng = r.Engines(done, r.CONT)
    msgs = await r.run(eng, r.placed(return_token_ids=True))
    assert [b[0] for b in eng.bodies] == ["e1"] and msgs[-1].error is None
    assert resumes(msgs) == [("reset", "finished")] and faults(msgs) == [("e1", "error")]


class Silent(httpx.AsyncByteStream):
    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        await self.gate.wait()  # (set when the test ends: the deadline came first)
        yield b""


async def test_a_deadline_during_a_continuations_prefill_is_counted() -> None:
    """Every cut is counted in ``narwhal_resumes_total``: one whose continuation the deadline
    overtook counted nothing, and for a non-streaming client the dead engine's fault was dropped
    with it."""
    for stream in (True, False):
        gate = asyncio.Event()
        eng = r.Engines(r.FIRST_TWO, lambda body: httpx.Response(200, stream=Silent(gate)))
        p = replace(r.placed(stream=stream, return_token_ids=True), deadline=time.time() + 0.5)
        try:
            msgs = await r.run(eng, p)
        finally:
            gate.set()
        assert [b[0] for b in eng.bodies] == ["e1", "e2"]
        assert msgs[-1].error is not None and msgs[-1].error.code == "deadline_expired"
        assert resumes(msgs) == [("reset", "deadline")], (stream, resumes(msgs))
        assert faults(msgs) == [("e1", "error")], (stream, faults(msgs))


async def test_a_token_generated_again_brings_no_usage_chunk_of_its_own() -> None:
    """With ``continuous_usage_stats`` every continuation chunk carries usage; the chunk of a token
    the client already had (generated again from before the cut character) was dropped but its
    usage was not: a ``choices: []`` usage chunk in the middle of the stream."""
    def cont(body: dict[str, Any]) -> list[dict[str, Any]]:
        out = [v.cmpl("", [134]), v.cmpl("é", [109]), v.cmpl(" ok", [5], "length")]
        for i, ch in enumerate(out, 1):
            ch["usage"] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": i,
                           "total_tokens": len(body["prompt"]) + i}
        return out

    eng = v.Engines(v.sse(v.cmpl("a", [1], first=True), v.cmpl("", [134]), done=False), cont)
    msgs = await relay_run(eng, v.completion(max_tokens=4, return_token_ids=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    evs = [e for e in v.events(msgs) if isinstance(e, dict)]
    assert all(e["choices"] for e in evs[:-1]), evs  # only the last is usage alone
    assert v.text_of(msgs) == "aé ok" and evs[-1]["usage"]["completion_tokens"] == 4
