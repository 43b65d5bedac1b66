"""Bugs a review of this stop's own change found in it (ids-only chunks with continuous usage, the
include_reasoning refusal, SGLang's empty top_logprobs, a drain shortened by under a second); each
test failed before its mend; the comment says why the behaviour was a bug."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from narwhal_serve.admission.view import FleetView
from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.gateway.completion import CompletionHandler
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.pipeline import ids_only

M = [{"role": "user", "content": "hi"}]


def _parse(route: str, **extra: Any) -> None:
    body = {"model": "m", **({"messages": M} if route == "chat" else {"prompt": "hi"}), **extra}
    parse_request(route, json.dumps(body).encode(), model="m")  # type: ignore[arg-type]


def test_ids_only_chunk_with_continuous_usage_still_reaches_a_client_that_did_not_ask_for_ids() -> None:
    # relay/pipeline.py ids_only(): `if chunk.get("usage") is not None: return False`.  vLLM 0.32
    # (chat_completion/serving.py) skips a held-back token's chunk (delta None, no finish_reason)
    # whenever the request did not ask for return_token_ids -- before it attaches continuous usage.
    # A client streaming with stream_options.continuous_usage_stats (relayed: relay/resume.py:150)
    # gets usage on every chunk, so the router still forwards this empty-delta chunk (usage kept,
    # token_ids nulled) that vLLM itself never sends: the fix 777cdac does not hold for that client.
    # (Dropping it loses nothing: the next chunk carries the cumulative usage.)  Fix: ignore
    # `usage` in ids_only (the relay already strips/keeps it per client).
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": [42]}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    assert ids_only(chunk), "an ids-only chunk with continuous usage is forwarded to a client vLLM would never send it to"


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_include_reasoning_false_is_refused_where_vllm_hides_nothing(route: str) -> None:
    # protocol/options.py check_relayed_options refuses include_reasoning: false on every request.
    # vLLM withholds token IDs only when `not request.include_reasoning and parser is not None`
    # (hide_stream_metadata: a reasoning parser configured).  A fleet serving a model without a
    # reasoning parser (most models), an SGLang/openai-dialect fleet (the router checks no IDs
    # there), and the completions route (vLLM's CompletionRequest has no include_reasoning at all)
    # answered such requests correctly before; clients that send include_reasoning: false by
    # default (OpenRouter-style SDKs) now get 400 unsupported_option.  Fix: refuse only where it
    # matters (chat, vLLM engine with a reasoning parser), or send include_reasoning: true to the
    # engine and drop the reasoning fields from what the client sees.
    _parse(route, stream=True, include_reasoning=False)


def test_sglang_completion_logprobs_0_becomes_a_502() -> None:
    # assembly/logprobs.py CompletionLogprobs.feed now refuses arrays of different lengths.  SGLang
    # (serving_completions.py / utils.to_openai_style_logprobs) fills tokens, token_logprobs and
    # text_offset (-1) per token but top_logprobs only from meta_info.get("output_top_logprobs", []),
    # which is absent when top_logprobs_num is 0: `logprobs: 0` streams top_logprobs [] beside N
    # tokens.  A valid request (logprobs 0, non-streaming) to an SGLang engine is now a 502, and the
    # BadEngineResponse counts against a healthy engine's breaker.  Fix: accept an empty (or
    # absent) top_logprobs beside aligned tokens/token_logprobs, or compare only those two.
    asm = Assembler("completion", return_token_ids=False)
    asm.feed({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": "Hi", "finish_reason": None,
                           "logprobs": {"tokens": ["Hi"], "token_logprobs": [-0.1], "text_offset": [-1],
                                        "top_logprobs": []}}]})


async def test_a_shortened_drain_under_a_second_is_ignored_by_the_ingress_timer() -> None:
    # gateway/completion.py on_view: `abs(end - self._drain_end) < 1.0: return` -- meant to absorb
    # the view's shift jitter, it also drops a real change of the drain end: a second drain (which
    # can only shorten it, scheduler/admin.py drain) moving the end by less than a second leaves the
    # ingress ending its streams at the old end.  Fix: compare the scheduler's streams_end_at
    # unshifted (it changes only on a real new drain) and reschedule with the new shift.
    cfg = NarwhalConfig.model_validate({})
    handler = CompletionHandler(cfg, SimpleNamespace(local_relay=None), None, clock=lambda: 1000.0)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    handler.on_view(FleetView(engines=(), unavailable="draining", predictive=False, streams_end_at=1030.0))
    handler.on_view(FleetView(engines=(), unavailable="draining", predictive=False, streams_end_at=1029.3))
    assert handler._drain_timer is not None
    delay = handler._drain_timer.when() - loop.time()
    handler._drain_timer.cancel()
    assert delay < 29.5, f"the streams end {delay:.2f} s from now, after the shortened drain's end (29.3 s)"
