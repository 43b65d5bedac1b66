"""Where a resumed answer's cut character starts, found with the tokenizer (found by a read-only
review of that change; each test failed before its fix): the prompt's last tokens count, as vLLM's
detokenizer starts from them, and the Assembler's relay (``deployment.relay: assembler``) has the
tokenizer too."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from narwhal_serve.relay.pipeline import Relay
from narwhal_serve.relay.resume import held_back
from tests.unit.ha import test_resume_vllm_semantics as v

# byte-level tokens: 134 is the first byte of "é" (0xC3), 109 its second (0xA9)
BYTES = {1: b"a", 134: b"\xc3", 109: b"\xa9", 5: b" ok", 7: b"q", 8: b"r"}


def decode(ids: list[int]) -> str:
    return b"".join(BYTES.get(i, b"?") for i in ids).decode("utf-8", errors="replace")


PROMPT = [7, 8, 134]  # a token-ID prompt whose last token is the first byte of "é"


def test_held_back_ignores_a_prompt_that_ends_inside_a_character() -> None:
    """vLLM's DecodeStream is primed with the prompt (v1/engine/detokenizer.py): the output's
    first token 109 completes the prompt's "é" and its text is sent; only the trailing 134 is held.
    ``held_back`` decodes the output alone and counts both."""
    assert held_back(decode, [109, 134], PROMPT) == 1
    assert held_back(decode, [109, 134]) == 2  # (without the prompt: both)


async def test_an_overcounted_hold_back_leaks_the_prompt_text_into_the_answer() -> None:
    """Consequence: the continuation is sent the prompt alone (kept = 0), which ends mid-character,
    and vLLM then writes the prompt's text again into the answer (the thing Transcript.settle was
    meant to prevent)."""
    first = {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m",
             "choices": [{"index": 0, "text": "é", "logprobs": None, "finish_reason": None, "stop_reason": None,
                          "prompt_token_ids": PROMPT, "token_ids": [109, 134]}]}

    def cont(body: dict[str, Any]) -> list[dict[str, Any]]:
        if body["prompt"][-1] == 134:  # started mid-character: the prompt's text comes again (vLLM)
            return [v.cmpl("qré", [109]), v.cmpl("", [134]), v.cmpl("é", [109]), v.cmpl(" ok", [5], "length")]
        return [v.cmpl("", [134]), v.cmpl("é", [109]), v.cmpl(" ok", [5], "length")]

    eng = v.Engines(v.sse(first, done=False), cont)
    p = v.placed("completion", {"prompt": PROMPT, "max_tokens": 4, "return_token_ids": True})
    async with httpx.AsyncClient(transport=httpx.MockTransport(eng)) as client:
        relay = Relay(client)
        relay.detokenize = decode
        msgs = [m async for m in relay.run(p)]
    assert eng.bodies[-1][1]["prompt"] == [*PROMPT, 109], eng.bodies[-1][1]["prompt"]
    assert v.text_of(msgs) == "éé ok", v.text_of(msgs)


def test_the_assembler_relay_gets_the_tokenizer_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/contract.md: a cut after a chunk of several tokens is resumed with the served model's
    tokenizer.  With ``deployment.relay: assembler`` the relay lives in the Assembler replica and
    gateway/app.py's wiring (backend.local_relay) never reaches it: every such cut is not_exact
    even though the router has a tokenizer."""
    import deployments.assembler
    from deployments.assembler import Assembler

    # (a replica's log wiring, on this process's "narwhal" logger, would outlive the test)
    monkeypatch.setattr(deployments.assembler, "to_serve_log", lambda: None)
    a = Assembler(engine_http="httpx", tokenizer="narwhal-sim")
    assert a.relay.detokenize is not None
    assert Assembler(engine_http="httpx").relay.detokenize is None  # (the estimate: no tokenizer)


async def test_a_tokenizer_that_cannot_decode_leaves_the_cut_unresumed() -> None:
    """(A tokenizer that raises on these IDs: the cut is not resumed, the stream ends with its
    error event as any such cut, not with a fault in the relay.)"""
    def broken(ids: list[int]) -> str:
        raise ValueError("not this model's IDs")

    first = {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m",
             "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None, "stop_reason": None,
                          "prompt_token_ids": v.PROMPT, "token_ids": [1, 134]}]}
    eng = v.Engines(v.sse(first, done=False), lambda body: [v.cmpl(" ok", [5], "length")])
    p = v.completion(max_tokens=4, return_token_ids=True)
    async with httpx.AsyncClient(transport=httpx.MockTransport(eng)) as client:
        relay = Relay(client)
        relay.detokenize = broken
        msgs = [m async for m in relay.run(p)]
    assert eng.hosts == ["e1"] and msgs[-1].error is not None
    assert [x for m in msgs for x in m.resumes] == [("reset", "not_exact")]
