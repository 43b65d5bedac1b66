"""A non-streaming chat whose ``tool_choice`` forces a tool: vLLM 0.32 answers ``content: ""``
(chat_completion/serving.py, the named/required branch: ``content=content or ""``), SGLang and
OpenAI null (SGLang serving_chat.py ``content=text if text else None``). The router assembles the
answer from the engine's stream, where no content delta comes: it gave null for every engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from narwhal_serve.assembly.fold import Assembler
from tests.unit.test_dialect_shapes import placed, run, sse

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
CALL = {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": ""}}


def tool_stream(finish: str) -> bytes:
    def ch(delta: dict[str, Any], ids: list[int], fin: str | None = None) -> dict[str, Any]:
        return {**HEAD, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin,
                                     "token_ids": ids}]}
    first = {**HEAD, "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None, "token_ids": None}]}
    usage = {**HEAD, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    return sse(first, ch({"tool_calls": [CALL]}, [5]),
               ch({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]}, [6]),
               ch({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, [7], finish), usage)


@pytest.mark.parametrize("tool_choice,finish", [
    ({"type": "function", "function": {"name": "f"}}, "stop"), ("required", "tool_calls")])
async def test_vllm_forced_tool_call_assembles_empty_content(tool_choice: object, finish: str) -> None:
    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": tool_choice}
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(tool_stream(finish))),
                        placed("chat", "vllm", stream=False, body=body))
    assert msgs[-1].error is None, msgs[-1].error
    choice = json.loads(msgs[-1].data)["choices"][0]
    assert choice["message"]["content"] == ""
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{\"a\":1}"}
    assert choice["finish_reason"] == finish


async def test_vllm_auto_tool_call_keeps_null_content() -> None:
    """tool_choice auto (vLLM's auto branch: ``content=content``, None when the parser took it all)."""
    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto"}
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(tool_stream("tool_calls"))),
                        placed("chat", "vllm", stream=False, body=body))
    assert json.loads(msgs[-1].data)["choices"][0]["message"]["content"] is None


def test_streamed_content_wins_over_the_forced_default() -> None:
    asm = Assembler("chat", return_token_ids=False, forced_tool_content="")
    asm.feed({**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    asm.feed({**HEAD, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    assert asm.result()["choices"][0]["message"]["content"] == "hi"
    plain = Assembler("chat", return_token_ids=False)
    plain.feed({**HEAD, "choices": [{"index": 0, "delta": {"tool_calls": [CALL]}, "finish_reason": "stop"}]})
    assert plain.result()["choices"][0]["message"]["content"] is None
