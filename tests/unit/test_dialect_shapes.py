"""What real `sglang` and `openai` dialect engines send in ordinary answers, replayed against Narwhal
(a differential review of their sources; each test's docstring names the shape and where it was read):
SGLang's per-choice ``matched_stop`` and flat error bodies, its managed launch flags (metrics, the
priority order), a plain server without /health or /metrics routes, a chat-only server's probe, output
counted from the engine's usage, the legacy ``function_call`` stream, Azure OpenAI's filter results.
Each test's docstring also says what Narwhal did with the shape before it was handled (2026-12-06)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.errors import BadEngineResponse
from narwhal_serve.config import EngineConfig
from narwhal_serve.config.launch import LaunchSpec
from narwhal_serve.managed.command import engine_argv
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.prefix import prompt_text
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import check_messages, parse_request
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from narwhal_serve.scheduler.monitor import probe_one, scrape_one
from tests.support.relay import faults_of


# ---------------------------------------------------------------------------------------------- helpers


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


class Parts(httpx.AsyncByteStream):
    """A body in several network reads, ``gap`` seconds apart."""

    def __init__(self, *parts: bytes, gap: float) -> None:
        self.parts, self.gap = parts, gap

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for i, p in enumerate(self.parts):
            if i:
                await asyncio.sleep(self.gap)
            yield p


def engines(dialect: str) -> tuple[EngineConfig, EngineConfig]:
    return (EngineConfig(name="e1", url="http://e1", dialect=dialect),  # type: ignore[arg-type]
            EngineConfig(name="e2", url="http://e2", dialect=dialect))  # type: ignore[arg-type]


def placed(route: str, dialect: str, stream: bool, body: dict[str, Any] | None = None,
           first_token_s: float | None = None) -> PlacedRequest:
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "q"}]} if route == "chat" else {"prompt": "q"})
    raw = json.dumps({"model": "m", "stream": stream, **base, **(body or {})})
    req = parse_request(route, raw.encode(), model="m")  # type: ignore[arg-type]
    e1, e2 = engines(dialect)
    routes = (RouteChoice(kind="single", decode=e1), RouteChoice(kind="single", decode=e2))
    return PlacedRequest("rid-1", "m", req, routes, time.time() + 30, first_token_s=first_token_s)


async def run(handler: Callable[[httpx.Request], httpx.Response], p: PlacedRequest) -> tuple[list[RelayMessage], list[str]]:
    seen: list[str] = []

    def h(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.host)
        return handler(req)

    async with httpx.AsyncClient(transport=httpx.MockTransport(h)) as client:
        msgs = [m async for m in Relay(client).run(p)]
    return msgs, seen


def all_faults(msgs: list[RelayMessage]) -> list[Any]:
    return [f for m in msgs for f in faults_of(m)]


# ------------------------------------------------------------------------------- SGLang: matched_stop

SG_CHAT = {"id": "5f1c", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def sg_chat_stream() -> bytes:
    """SGLang's chat stream, as serving_chat.py `_generate_chat_stream` + sse_utils.build_sse_content
    write it: role chunk, content chunks, then one finish chunk per choice carrying
    ``matched_stop = finish_reason["matched"]`` (the EOS token ID for a natural stop), then the
    usage chunk (``choices: []``, UsageInfo with ``prompt_tokens_details`` and ``reasoning_tokens``)."""
    def ch(delta: dict[str, Any], finish: str | None = None, matched: Any = None) -> dict[str, Any]:
        return {**SG_CHAT, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                        "finish_reason": finish, "matched_stop": matched}]}
    usage = {**SG_CHAT, "choices": [], "usage": {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2,
                                                 "prompt_tokens_details": None, "reasoning_tokens": 0}}
    return sse(ch({"role": "assistant", "content": ""}), ch({"content": "Hel"}), ch({"content": "lo"}),
               ch({}, "stop", 151645), usage)


async def test_sglang_chat_eos_stop_assembles_nonstreaming() -> None:
    """python/sglang/srt/entrypoints/openai/protocol.py: ChatCompletionResponseStreamChoice.matched_stop
    (Union[None, int, str]); serving_chat.py sends it on the finish chunk of every EOS/stop-string end.
    Kept in the assembled choice (it was refused as an unknown field: a 502 and an `error` fault on
    every SGLang engine)."""
    msgs, seen = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(sg_chat_stream())),
                           placed("chat", "sglang", stream=False))
    last = msgs[-1]
    assert last.error is None, (last.error, seen)
    choice = json.loads(last.data)["choices"][0]
    assert choice["message"]["content"] == "Hello" and choice["matched_stop"] == 151645
    assert all_faults(msgs) == []


async def test_sglang_completion_stop_string_assembles_nonstreaming() -> None:
    """serving_completions.py `_generate_completion_stream`: CompletionResponseStreamChoice(...,
    matched_stop=finish_reason["matched"]) on the last text chunk (here the matched stop string)."""
    head = {"id": "9a0b", "object": "text_completion", "created": 1, "model": "m"}
    body = sse(
        {**head, "choices": [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None,
                              "matched_stop": None}], "usage": None},
        {**head, "choices": [{"index": 0, "text": "lo", "logprobs": None, "finish_reason": "stop",
                              "matched_stop": "\n"}], "usage": None},
        {**head, "choices": [], "usage": {"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2,
                                          "reasoning_tokens": 0}},
    )
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(body)),
                        placed("completion", "sglang", stream=False))
    assert msgs[-1].error is None, msgs[-1].error
    assert json.loads(msgs[-1].data)["choices"][0]["text"] == "Hello"
    assert all_faults(msgs) == []


# --------------------------------------------------------------------------- SGLang: flat error bodies


async def test_sglang_400_message_reaches_the_client() -> None:
    """serving_base.py create_error_response: ORJSONResponse(ErrorResponse(object="error", message, type,
    param, code).model_dump()) — a FLAT body, not OpenAI's {"error": {...}} envelope.  Narwhal reads
    it too (it read only body["error"]: the client's 400 said "HTTP 400" without SGLang's reason)."""
    sg_err = {"object": "error", "message": "The input (40000 tokens) is longer than the model's context "
              "length (32768 tokens).", "type": "BadRequestError", "param": None, "code": 400}
    msgs, seen = await run(lambda r: httpx.Response(400, json=sg_err), placed("chat", "sglang", stream=True))
    err = msgs[-1].error
    assert err is not None and err.status == 400 and seen == ["e1"]
    assert "longer than the model's context length" in err.message, err.message


# ---------------------------------------------------------------------- SGLang: managed launch flags


def test_managed_sglang_serves_metrics() -> None:
    """SGLang serves /metrics only with --enable-metrics (docs/references/production_metrics.md; default
    off).  Narwhal's eligibility needs a 200 /metrics (EngineState.fresh), yet engine_argv launches SGLang
    with it (without it a managed SGLang engine was never eligible)."""
    spec = LaunchSpec(kind="sglang", model="/models/m")
    argv = engine_argv(spec, name="s0", model="m", role="unified", dialect="sglang", host="127.0.0.1",
                       port=30000, python="python")
    assert "--enable-metrics" in argv, argv


def test_managed_sglang_priority_polarity_matches_class_rank() -> None:
    """SGLang server_args: --enable-priority-scheduling "Requests with higher priority integer values
    will be scheduled first by default"; --schedule-low-priority-values-first flips it.  Narwhal sends
    rank 0 for the top class (docs/contract.md: "lower runs first in both engines") but launches SGLang
    with --enable-priority-scheduling only, so its top class is scheduled last."""
    spec = LaunchSpec(kind="sglang", model="/models/m")
    argv = engine_argv(spec, name="s0", model="m", role="unified", dialect="sglang", host="127.0.0.1",
                       port=30000, python="python", priority=True)
    assert "--enable-priority-scheduling" in argv
    assert "--schedule-low-priority-values-first" in argv, argv


# ------------------------------------------------------------------- openai: health, probe, metrics


async def test_openai_dialect_engine_without_prometheus_metrics_is_eligible() -> None:
    """A plain OpenAI-compatible server has no Prometheus /metrics (404; e.g. llama.cpp without
    --metrics, SGLang without --enable-metrics).  The 404 is an answer: the engine is eligible, its
    load unpublished (scraped() never set last_ok: every request got 503 backend_unavailable)."""
    def h(r: httpx.Request) -> httpx.Response:
        if r.url.path == "/health":
            return httpx.Response(200)
        if r.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        return httpx.Response(404, json={"error": {"message": "Not found", "type": "invalid_request_error"}})

    e = EngineState(EngineConfig(name="o1", url="http://o1", dialect="openai"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(h)) as client:
        now = time.time()
        await scrape_one(client, e, now, 1.0)
    assert e.healthy
    assert e.eligible(now, 5.0, frozenset()), "openai-dialect engine without /metrics not eligible"


async def test_openai_probe_accepts_a_chat_only_server() -> None:
    """OpenAI answers a chat model on /v1/completions with 404 ("This is a chat model and not supported
    in the v1/completions endpoint.  Did you mean to use v1/chat/completions?").  probe_one only tries
    /v1/completions, so an openai-dialect engine serving a chat model never passes the probe: once its
    breaker opens it is re-opened for ever (twice as long each time)."""
    def h(r: httpx.Request) -> httpx.Response:
        if r.url.path == "/v1/completions":
            return httpx.Response(404, json={"error": {
                "message": "This is a chat model and not supported in the v1/completions endpoint. "
                           "Did you mean to use v1/chat/completions?",
                "type": "invalid_request_error", "param": "model", "code": None}})
        return httpx.Response(200, json={
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "p", "refusal": None,
                                                 "annotations": []}, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}})

    e = EngineState(EngineConfig(name="o1", url="http://o1", dialect="openai"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(h)) as client:
        ok, why = await probe_one(client, e, "m", 1.0)
    assert ok, why


# ------------------------------------------------------------------------ openai: usage and timing

O_HEAD = {"id": "chatcmpl-o", "object": "chat.completion.chunk", "created": 1, "model": "o4-mini",
          "service_tier": "default", "system_fingerprint": None}


async def test_openai_output_tokens_are_counted_from_engine_usage() -> None:
    """OpenAI reasoning models never stream their reasoning tokens; the final usage chunk (choices: [],
    asked for by Narwhal itself: engines/dialect.py streaming_body, "when output can only be counted from
    usage") says completion_tokens 40 with completion_tokens_details.reasoning_tokens 38.  The relay's
    stats (tenant output-token charges, output-length learning) count 2 content events instead."""
    usage = {"prompt_tokens": 9, "completion_tokens": 40, "total_tokens": 49,
             "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
             "completion_tokens_details": {"reasoning_tokens": 38, "audio_tokens": 0,
                                           "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}

    def ch(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**O_HEAD, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                "usage": None, "obfuscation": "xYz"}
    body = sse(ch({"role": "assistant", "content": "", "refusal": None}), ch({"content": "Hi"}),
               ch({"content": "!"}), ch({}, "stop"), {**O_HEAD, "choices": [], "usage": usage, "obfuscation": "q"})
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(body)),
                        placed("chat", "openai", stream=True, body={"stream_options": {"include_usage": True}}))
    stats = msgs[-1].stats
    assert msgs[-1].error is None and stats is not None
    assert b'"completion_tokens":40' in b"".join(m.data for m in msgs)  # the client sees the engine's count ...
    assert stats.output_tokens == 40, stats.output_tokens  # ... the router charges another


async def test_openai_legacy_function_call_stream_is_a_first_token() -> None:
    """OpenAI chat with the (deprecated, still served) `functions` parameter streams
    delta.function_call {name, arguments} fragments and no content.  The relay's Meter (content_events)
    does not count function_call, so the answer never has a first token: with another route left, the
    first-token limit fires mid-answer and the engine is charged a `timeout` fault."""
    def ch(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**O_HEAD, "model": "gpt-4o", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                          "finish_reason": finish}]}
    parts = (sse(ch({"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                             "arguments": ""}}), done=False),
             sse(ch({"function_call": {"arguments": "{\"city\":"}}), done=False),
             sse(ch({"function_call": {"arguments": "\"Paris\"}"}}), ch({}, "function_call")))
    msgs, seen = await run(lambda r: httpx.Response(200, stream=Parts(*parts, gap=0.2)),
                           placed("chat", "openai", stream=True, first_token_s=0.3))
    assert all_faults(msgs) == [], all_faults(msgs)
    assert seen == ["e1"]


# ---------------------------------------------------------------- openai (Azure OpenAI) stream shapes

AZ_PROMPT_FILTER = {"choices": [], "created": 0, "id": "", "model": "", "object": "", "prompt_filter_results": [
    {"prompt_index": 0, "content_filter_results": {"hate": {"filtered": False, "severity": "safe"},
                                                   "self_harm": {"filtered": False, "severity": "safe"},
                                                   "sexual": {"filtered": False, "severity": "safe"},
                                                   "violence": {"filtered": False, "severity": "safe"}}}]}
SAFE = {"hate": {"filtered": False, "severity": "safe"}, "self_harm": {"filtered": False, "severity": "safe"},
        "sexual": {"filtered": False, "severity": "safe"}, "violence": {"filtered": False, "severity": "safe"}}


async def test_azure_openai_content_filter_results_assemble_nonstreaming() -> None:
    """Azure OpenAI (an OpenAI-compatible server; shapes as in Azure's content-streaming docs and
    semantic-kernel's recorded Azure streams): choices carry `content_filter_results`.  The assembler
    refuses the valued choice key → 502 and an `error` fault on each engine, for every answer."""
    head = {"id": "chatcmpl-az", "object": "chat.completion.chunk", "created": 1704212243, "model": "gpt-4o",
            "system_fingerprint": "fp_1"}
    body = sse(
        AZ_PROMPT_FILTER,
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None, "content_filter_results": {}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None, "logprobs": None,
                              "content_filter_results": SAFE}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None,
                              "content_filter_results": {}}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}},
    )
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(body)),
                        placed("chat", "openai", stream=False))
    assert msgs[-1].error is None, msgs[-1].error
    assert all_faults(msgs) == []
    assert json.loads(msgs[-1].data)["choices"][0]["content_filter_results"] == SAFE  # (the finish chunk's {} kept none)


def test_azure_openai_prompt_filter_chunk_does_not_blank_the_answer_id() -> None:
    """Azure's first chunk is `{"choices": [], "created": 0, "id": "", "model": "", ...}` (prompt filter
    results).  The assembler keeps the FIRST non-null id/created, so the assembled answer's id is ""
    and created 0 instead of the completion's own."""
    head = {"id": "chatcmpl-az", "object": "chat.completion.chunk", "created": 1704212243, "model": "gpt-4o"}
    asm = Assembler("chat", return_token_ids=False)
    for c in (AZ_PROMPT_FILTER,
              {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                                    "finish_reason": "stop", "logprobs": None}]},
              {**head, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}):
        asm.feed(c)
    out = asm.result(prompt_tokens=5)
    assert (out["id"], out["created"]) == ("chatcmpl-az", 1704212243), (out["id"], out["created"])


@pytest.mark.parametrize("key,value", [("id", 0), ("created", False), ("model", []), ("id", {}), ("created", "")])
def test_wrong_typed_blank_metadata_is_still_refused(key: str, value: object) -> None:
    """Only a blank of the right type ("" for id / model, 0 for created: Azure's first chunk) waits
    for the answer's own; a wrong-typed one is still a 502 (from a review of this stop's diff)."""
    asm = Assembler("chat", return_token_ids=False)
    chunk = {"id": "x", "created": 1, "model": "m", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
    chunk[key] = value
    with pytest.raises(BadEngineResponse):
        asm.feed(chunk)


def test_prefix_text_reads_the_text_parts_the_request_check_takes() -> None:
    """The prefix index's text of a prompt reads the text parts the request check takes (plain
    strings, refusal and thinking parts): it read dict parts' ``text`` only, so without a tokenizer
    two different prompts hashed to the same prefix blocks (from a review of this stop's diff)."""
    a = {"messages": [{"role": "user", "content": ["What is the capital of France? " * 20]}]}
    b = {"messages": [{"role": "user", "content": ["Write me a poem about the sea. " * 20]}]}
    check_messages(a)
    check_messages(b)  # both accepted now
    assert prompt_text("chat", a) != prompt_text("chat", b)


def test_prefix_text_reads_a_thinking_part() -> None:
    a = {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "A" * 600}]}]}
    b = {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "B" * 600}]}]}
    check_messages(a)
    check_messages(b)
    assert prompt_text("chat", a) != prompt_text("chat", b)
