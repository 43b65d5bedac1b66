"""Assembling real vLLM 0.32.0 streams reproduces vLLM's own non-streaming responses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.assembly.tokens import check_token_ids

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32.0-cpu"


def sse(name: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    return data


def assemble(route: str, name: str, *, return_token_ids: bool = True) -> Assembler:
    asm = Assembler(route, return_token_ids=return_token_ids)  # type: ignore[arg-type]
    for chunk in sse(name):
        asm.feed(chunk)
    return asm


COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def test_chat_stream_assembles_to_nonstream_response() -> None:
    got = assemble("chat", "chat_stream_logprobs_tokenids_usage.sse").result()
    want = load("chat_nonstream_logprobs_tokenids.json")
    gc, wc = got["choices"][0], want["choices"][0]
    assert gc["message"]["content"] == wc["message"]["content"] == "11actark\ufffdref"
    assert gc["message"] == wc["message"]  # the whole message shape, nulls included
    for key in ("logprobs", "token_ids", "finish_reason", "stop_reason", "index"):
        assert gc[key] == wc[key], key
    assert set(gc) == set(wc)
    assert {k: got["usage"][k] for k in COUNTS} == {k: want["usage"][k] for k in COUNTS}
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    assert got["object"] == want["object"] == "chat.completion"
    assert got["system_fingerprint"] == want["system_fingerprint"]
    # same keys as vLLM's response, less the disaggregation internals
    assert set(got) == set(want) - {"kv_transfer_params", "ec_transfer_params"}
    assert got["id"] == "chatcmpl-83a1839225c5bfe8" and got["created"] == 1795986435
    assert got["model"] == "tiny"


def test_completion_stream_assembles_to_nonstream_response() -> None:
    asm = assemble("completion", "completion_stream_logprobs_tokenids_usage.sse")
    got = asm.result()
    want = load("completion_nonstream_logprobs_tokenids.json")
    gc, wc = got["choices"][0], want["choices"][0]
    assert gc["text"] == wc["text"]
    for key in ("logprobs", "token_ids", "finish_reason", "stop_reason", "prompt_token_ids", "index"):
        assert gc[key] == wc[key], key
    assert set(gc) == set(wc)
    assert {k: got["usage"][k] for k in COUNTS} == {k: want["usage"][k] for k in COUNTS}
    assert set(got) == set(want) - {"kv_transfer_params", "ec_transfer_params"}
    assert got["object"] == "text_completion"
    assert asm.prompt_token_ids == [0, 322, 528, 269, 14]
    assert asm.output_tokens == 6


def test_plain_chat_stream_assembles_without_ids() -> None:
    asm = assemble("chat", "chat_stream_plain.sse", return_token_ids=False)
    got = asm.result(prompt_tokens=8)
    choice = got["choices"][0]
    assert choice["message"]["content"] == "11actark\ufffdref"
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] is None and got["prompt_token_ids"] is None  # (not asked: null, as vLLM answers)
    # no engine usage: computed from the prompt length and the 6 token events
    assert asm.output_tokens == 6
    assert got["usage"] == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14,
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    assert asm.result()["usage"]["prompt_tokens"] == 0  # nothing known about the prompt


def test_plain_chat_stream_asked_for_ids_gets_null() -> None:
    got = assemble("chat", "chat_stream_plain.sse", return_token_ids=True).result()
    assert got["choices"][0]["token_ids"] is None
    assert got["prompt_token_ids"] is None


def test_stop_string_keeps_stop_reason() -> None:
    asm = assemble("chat", "chat_stream_stop_string.sse")
    got = asm.result()
    choice = got["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "e"
    assert asm.finish_reason == "stop" and asm.stop_reason == "e"
    assert choice["message"]["content"] == "t"
    assert choice["token_ids"] == [1397]
    # no usage frame: computed from the prompt IDs and the one generated ID
    assert got["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
                            "prompt_tokens_details": None, "completion_tokens_details": None}


@pytest.mark.parametrize(("route", "name"), [
    ("chat", "chat_stream_logprobs_tokenids_usage.sse"),
    ("completion", "completion_stream_logprobs_tokenids_usage.sse"),
])
def test_reasons_survive_usage_only_frame(route: str, name: str) -> None:
    chunks = sse(name)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] is not None
    asm = Assembler(route, return_token_ids=False)  # type: ignore[arg-type]
    for chunk in chunks[:-1]:
        asm.feed(chunk)
    before = asm.result()
    asm.feed(chunks[-1])
    after = asm.result()
    assert asm.finish_reason == "length"
    assert after["choices"][0]["finish_reason"] == before["choices"][0]["finish_reason"] == "length"
    assert "stop_reason" in after["choices"][0] and after["choices"][0]["stop_reason"] is None
    assert after["usage"] == {**chunks[-1]["usage"], "prompt_tokens_details": None, "completion_tokens_details": None}


def test_token_checks_pass_on_recorded_streams() -> None:
    for route, name, total in [("chat", "chat_stream_logprobs_tokenids_usage.sse", 6),
                               ("chat", "chat_stream_stop_string.sse", 1),
                               ("completion", "completion_stream_logprobs_tokenids_usage.sse", 6)]:
        counts = [check_token_ids(c, route) for c in sse(name)]  # type: ignore[arg-type]
        assert sum(counts) == total
