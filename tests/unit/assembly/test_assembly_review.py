"""Non-streaming assembly and token-ID exposure against vLLM 0.32.0, from a review.

Each test failed before its fix; its comment says what is correct and why (the spec row, or the vLLM
0.32 source under .cache/vllm-venv/lib/python3.11/site-packages/vllm/entrypoints/openai/, or the
recorded vLLM 0.32.0 fixtures in tests/fixtures/vllm-0.32.0-cpu/).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from narwhal_serve.assembly.exposure import expose
from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.assembly.tokens import check_token_ids
from narwhal_serve.errors import BadEngineResponse, InvalidRequest
from narwhal_serve.protocol.requests import parse_request

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32.0-cpu"
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CHEAD = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}


def sse(name: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):])
            for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    return data


def assemble(route: str, chunks: list[dict[str, Any]], *, return_token_ids: bool = False) -> dict[str, Any]:
    asm = Assembler(route, return_token_ids=return_token_ids)  # type: ignore[arg-type]
    for chunk in chunks:
        asm.feed(chunk)
    return asm.result()


# ---------------------------------------------------------------- null vs absent (vLLM's shapes)


def test_nonstream_without_return_token_ids_has_null_token_id_fields() -> None:
    # vLLM 0.32 serializes its non-streaming answer with a plain model_dump() (chat_completion/
    # api_router.py:71, completion/api_router.py:63), so a client that did not ask for token IDs gets
    # "token_ids": null on every choice (chat_completion/protocol.py:121, completion/protocol.py:667)
    # and "prompt_token_ids": null (chat top level, protocol.py:146; completion choice,
    # protocol.py:669), as the recorded vLLM answer shows (completion_prefill_leg_no_connector.json:
    # "token_ids":null,...,"prompt_token_ids":null).  Null hides the IDs just as well; Narwhal
    # dropped the keys instead.
    want = load("completion_prefill_leg_no_connector.json")
    got = assemble("completion", sse("completion_stream_logprobs_tokenids_usage.sse"))
    assert list(got["choices"][0]) == list(want["choices"][0])
    chat = assemble("chat", sse("chat_stream_logprobs_tokenids_usage.sse"))
    assert chat["choices"][0].get("token_ids", "absent") is None
    assert chat.get("prompt_token_ids", "absent") is None


def test_stream_exposure_keeps_vllm_null_token_id_fields() -> None:
    # What vLLM 0.32 streams to a client that did not ask for token IDs (the recorded
    # chat_stream_plain.sse): every choice carries "token_ids": null (chat_completion/serving.py:
    # 759/787 set it explicitly, and exclude_unset=True keeps explicitly set Nones, serving.py:829),
    # and the first chunk "prompt_token_ids": null (serving.py:567).  Narwhal always asks the
    # engine for IDs, so expose() must hide them in vLLM's own shape, not delete the keys
    # (exposure.py:43-49).
    plain = sse("chat_stream_plain.sse")
    with_ids = sse("chat_stream_logprobs_tokenids_usage.sse")
    first = expose(copy.deepcopy(with_ids[0]), return_token_ids=False)
    token = expose(copy.deepcopy(with_ids[1]), return_token_ids=False)
    assert first.get("prompt_token_ids", "absent") == plain[0]["prompt_token_ids"] is None
    assert token["choices"][0].get("token_ids", "absent") == plain[1]["choices"][0]["token_ids"] is None


def test_assembled_usage_has_vllm_nonstream_shape() -> None:
    # vLLM's non-streaming usage is UsageInfo.model_dump() (serve/engine/protocol.py:135-140):
    # prompt_tokens_details and completion_tokens_details are present, null when unused
    # (chat_nonstream_logprobs_tokenids.json).  The streamed usage chunk drops them
    # (exclude_none=True, chat_completion/serving.py:890), so the assembler must restore them;
    # it keeps the streamed object as sent (usage.py:20) and computes one without them (usage.py:25).
    want = load("chat_nonstream_logprobs_tokenids.json")["usage"]
    got = assemble("chat", sse("chat_stream_logprobs_tokenids_usage.sse"))["usage"]
    assert set(got) == set(want)


# ---------------------------------------------------------------- 502 for what is not assembled / malformed


def test_valued_routed_experts_is_not_silently_dropped() -> None:
    # Spec: "The assembler returns HTTP 502 for unsupported choice ... fields that carry a value".
    # routed_experts is listed as known (chat_fold.py:44-45, completion_fold.py:19-20) but never
    # assembled: result() always writes null (chat_fold.py:175, completion_fold.py:51), so an
    # engine's value is silently replaced by null instead of being refused (or kept).
    chunks = [{**HEAD, "choices": [{"index": 0, "delta": {"content": "a"}, "routed_experts": "k05VTVBZ",
                                     "finish_reason": "stop"}]}]
    asm = Assembler("chat", return_token_ids=False)
    try:
        for chunk in chunks:
            asm.feed(chunk)
        got = asm.result()
    except BadEngineResponse:
        return  # refused: correct
    assert got["choices"][0]["routed_experts"] == "k05VTVBZ"  # or kept: also faithful


@pytest.mark.parametrize("entry", [
    {"logprob": -0.1, "bytes": [97], "top_logprobs": []},  # no token
    {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": "oops"},  # top_logprobs not a list
    {"token": "a", "logprob": -0.1, "bytes": "a", "top_logprobs": []},  # bytes not a list
])
def test_malformed_chat_logprob_entry_is_502(entry: dict[str, Any]) -> None:
    # Spec: 502 "for malformed supported fields".  vLLM's entry is ChatCompletionLogProbsContent
    # (chat_completion/protocol.py:89-99): token: str (required), bytes: list[int] | None,
    # top_logprobs: list[...].  logprobs.py:63-72 checks only token/logprob types and lets a
    # missing token or a non-list top_logprobs/bytes through into the client's answer.
    chunk = {**HEAD, "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry]},
                                  "finish_reason": "stop"}]}
    with pytest.raises(BadEngineResponse):
        assemble("chat", [chunk])


def test_misaligned_completion_logprob_arrays_are_502() -> None:
    # vLLM's CompletionLogProbs arrays are parallel, one entry per token (completion/serving.py:
    # 652-731 appends to all four per token).  A chunk whose arrays differ in length is malformed
    # (spec: 502 for malformed supported fields); logprobs.py:87-95 concatenates each array on its
    # own, so the assembled offsets/logprobs no longer line up with the tokens.
    chunk = {**CHEAD, "choices": [{"index": 0, "text": "ab", "finish_reason": "stop",
                                   "logprobs": {"tokens": ["a", "b"], "text_offset": [0],
                                                "token_logprobs": [-0.1], "top_logprobs": [None]}}]}
    with pytest.raises(BadEngineResponse):
        assemble("completion", [chunk])


# ---------------------------------------------------------------- options whose answer the relay cannot give


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_nonstream_prompt_logprobs_zero_is_not_silently_null(route: str) -> None:
    # vLLM 0.32 serves prompt_logprobs: 0 without streaming (chat_completion/protocol.py:863-866
    # refuses only stream=True with > 0) and answers a list (chat: serving.py:1198; completion:
    # completion/serving.py:587), since LogprobsProcessor builds prompt logprobs whenever the
    # value is not None (v1/engine/logprobs.py:55-68).  Narwhal accepts it (protocol/options.py check_relayed_options),
    # strips it from the engine body (engines/vllm.py client_body) and the assembler returns
    # prompt_logprobs: null -- an answer that silently leaves out what was asked for.  It should be
    # refused (400 unsupported_option) as prompt_logprobs > 0 is.
    if route == "chat":
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}
    else:
        body = {"model": "m", "prompt": "hi", "prompt_logprobs": 0}
    with pytest.raises(InvalidRequest):
        parse_request(route, json.dumps(body).encode(), model="m")  # type: ignore[arg-type]


# (include_reasoning: false — vLLM then leaves the token IDs out — is relayed as an engine's without IDs:
# tests/unit/core/test_relay.py test_a_chat_hiding_its_reasoning_is_counted_without_token_ids)
