"""A review of the router's tokenization against vLLM 0.32: each test shows one divergence (it fails
on the code as reviewed and passes once the divergence is mended).  The vLLM lines each test
follows are named beside it."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from narwhal_serve.errors import InvalidRequest
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.tokenization.chat import content_format, tool_dicts
from narwhal_serve.tokenization.hf import HfTokenizer
from narwhal_serve.tokenization.sizer import INLINE_CHARS, PromptSizer
from tests.support.tokenizer import prompt_threads


# ----------------------------------------------------------------------------- 1. empty text parts
#
# vLLM (renderers/chat_utils.py, _parse_chat_message_content_parts): each part is parsed, then kept
# only ``if parse_res:`` -- an empty string (a ``{"type": "text", "text": ""}`` part or a plain ""
# in a content list) is dropped before the texts are joined with "\n" for a ``string``-format
# template.  The router keeps it, so the message gets an extra "\n" (one token more, and other IDs).


@pytest.mark.parametrize("parts", [
    [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}],
    ["a", "", "b"],
])
def test_empty_text_parts_are_dropped_before_joining_as_vllm_drops_them(tok: HfTokenizer, parts: list[Any]) -> None:
    assert tok.chat_template is not None and content_format(tok.chat_template) == "string"
    want = tok.render_chat({"messages": [{"role": "user", "content": "a\nb"}]})  # vLLM: "\n".join(["a", "b"])
    body = {"messages": [{"role": "user", "content": parts}]}
    assert tok.render_chat(body) == want
    assert tok.prompt("chat", body).ids == tok.prompt("chat", {"messages": [{"role": "user", "content": "a\nb"}]}).ids


# ----------------------------------------------------------------------------- 2. the model's vocabulary
#
# vLLM 0.32 (renderers/base.py, validate_token_ids): a prompt token ID is out of vocabulary
# only past ``max(tokenizer.max_token_id, model_config.get_vocab_size() - 1)`` -- the model's own
# vocabulary (config.json ``vocab_size``) counts, which for Qwen-family models is larger than the
# tokenizer's (151936 embedding rows, 151665 tokens).  The router refuses every ID at or past the
# tokenizer's token count with a 400 the engine would not give.


def test_a_token_id_of_the_models_vocabulary_past_the_tokenizers_is_served(tok_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in tok_dir.iterdir():
        shutil.copy(f, model / f.name)
    base = HfTokenizer(tok_dir).vocab_size
    (model / "config.json").write_text(json.dumps({"vocab_size": base + 64, "max_position_embeddings": 512}))
    sizer = PromptSizer(HfTokenizer(model))

    def size(ids: list[int]) -> Any:
        raw = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode()
        return asyncio.run(sizer.size(parse_request("completion", raw, model="m")))

    padded = base + 10  # an embedding row of the model the tokenizer has no token for: vLLM takes it
    sized = size([5, padded])
    assert (sized.method, sized.ids) == ("client_ids", [5, padded])
    with pytest.raises(InvalidRequest):
        size([5, base + 64])  # past both: vLLM refuses it too


# ----------------------------------------------------------------------------- 3. the event loop
#
# sizer.py _prompt_chars decides whether a chat is tokenized on the event loop (<= INLINE_CHARS) or
# on the pool: a message whose content is a list of parts counts 1024 whatever its length, and the
# request's tools count nothing -- so a chat of one 100 KB text part, or a short message with 100 KB
# of tools, is rendered and tokenized on the event loop, stalling every other request meanwhile.

LONG = "the quick brown fox jumps over the lazy dog " * (4 * INLINE_CHARS // 44)


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": LONG}]}]},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}],
     "tools": [{"type": "function", "function": {"name": "f", "description": LONG, "parameters": {"type": "object"}}}]},
], ids=["text-part-list", "long-tools"])
def test_long_chats_are_tokenized_off_the_event_loop(tok: HfTokenizer, body: dict[str, Any]) -> None:
    sizer = PromptSizer(tok)
    with prompt_threads(tok) as threads:
        sized = asyncio.run(sizer.size(parse_request("chat", json.dumps(body).encode(), model="m")))
    assert sized.method == "tokenizer" and len(sized.ids or ()) > INLINE_CHARS // 8
    assert threads and threads[0].startswith("narwhal-tokenize"), threads


# ----------------------------------------------------------------------------- 4. defer_loading
#
# vLLM (entrypoints/openai/chat_completion/protocol.py, ChatCompletionToolsParam._propagate_defer_loading):
# ``if self.defer_loading is not None and self.function.defer_loading is None: self.function.defer_loading
# = self.defer_loading`` -- a function's explicit null is filled from the tool's value, as a missing one
# is.  The router's ``fn.get("defer_loading", tool.get(...))`` fills only a missing key.


def test_a_tools_defer_loading_fills_its_functions_null_one() -> None:
    tools = [{"type": "function", "defer_loading": True, "function": {"name": "f", "defer_loading": None}}]
    out = tool_dicts(tools)
    assert out is not None
    assert out[0]["function"].get("defer_loading") is True
    assert out[0].get("defer_loading") is True


def test_a_chat_with_long_tool_call_arguments_is_tokenized_off_the_event_loop(tok: HfTokenizer) -> None:
    """An assistant turn's tool-call arguments are rendered into the prompt: a chat whose text is
    short but whose arguments are long was tokenized on the event loop."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": LONG})}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    sizer = PromptSizer(tok)
    with prompt_threads(tok) as threads:
        sized = asyncio.run(sizer.size(parse_request("chat", json.dumps(body).encode(), model="m")))
    assert sized.method == "tokenizer" and threads and threads[0].startswith("narwhal-tokenize"), threads
