"""The project's own recordings (scripts/vllm_cpu_engine.py record): each seeded stream assembles to
the engine's own non-streaming answer to the same request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.assembly.tokens import check_token_ids

DIR = Path(__file__).resolve().parents[2] / "fixtures" / "vllm-recorded"


def chunks(name: str) -> list[dict[str, Any]]:
    lines = (DIR / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]


@pytest.mark.parametrize(("route", "stream", "full"), [
    ("chat", "chat_stream_logprobs_tokenids_usage.sse", "chat_nonstream_logprobs_tokenids.json"),
    ("completion", "completion_stream_logprobs_tokenids_usage.sse", "completion_nonstream_logprobs_tokenids.json"),
])
def test_recorded_stream_assembles_to_recorded_response(route: str, stream: str, full: str) -> None:
    asm = Assembler(route, return_token_ids=True)  # type: ignore[arg-type]
    total = 0
    for c in chunks(stream):
        total += check_token_ids(c, route)  # type: ignore[arg-type]
        asm.feed(c)
    got = asm.result()
    want = json.loads((DIR / full).read_text(encoding="utf-8"))
    g, w = got["choices"][0], want["choices"][0]
    for key in ("logprobs", "token_ids", "finish_reason", "stop_reason"):
        assert g[key] == w[key], key
    if route == "chat":
        assert g["message"]["content"] == w["message"]["content"]
        assert got["prompt_token_ids"] == want["prompt_token_ids"]
    else:
        assert g["text"] == w["text"] and g["prompt_token_ids"] == w["prompt_token_ids"]
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got["usage"][k] == want["usage"][k]
    assert total == want["usage"]["completion_tokens"] == len(g["token_ids"])


def test_recorded_stop_string_stream() -> None:
    cs = chunks("chat_stream_stop_string.sse")
    asm = Assembler("chat", return_token_ids=True)
    for c in cs:
        check_token_ids(c, "chat")
        asm.feed(c)
    choice = asm.result()["choices"][0]
    last = [c for c in cs if c.get("choices")][-1]["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == last["stop_reason"] is not None
