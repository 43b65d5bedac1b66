"""Review of the request side against vLLM 0.32's own OpenAI server: request shapes that vLLM
takes and real clients send, which Narwhal refused or altered before the engine saw them (each test
failed on 80fd9c9, 2026-12-06; prompt_embeds is now refused in its own words, documented).

Sources of the shapes:

- vLLM's chat content parts (vllm/renderers/chat_utils/types.py ``ChatCompletionContentPartParam``
  and parse_chat_message_content.py ``_parse_chat_message_content_part``): a plain ``str`` part
  (``if isinstance(part, str): ... return part``), and the embedding parts ``image_embeds`` /
  ``audio_embeds`` (``ChatCompletionContentPart{Image,Audio}EmbedsParam``, served with
  ``--enable-mm-embeds``).  LangChain's ChatOpenAI sends a plain string part as it is:
  ``langchain_openai.chat_models.base._format_message_content`` appends every block that is not a
  dict (``HumanMessage.content: str | list[str | dict]``).
- vLLM's ``CompletionRequest.prompt_embeds: bytes | list[bytes] | None`` with ``prompt`` optional
  (``validate_prompt_and_prompt_embeds``: "Either prompt or prompt_embeds must be provided and
  non-empty."), vLLM's docs, "Prompt Embedding Inputs", online serving, ``--enable-prompt-embeds``.
- vLLM's ``ChatCompletionRequest._normalize_messages_before`` (vllm-project/vllm#42664: "Clients
  like litellm send multi-turn reasoning content using the deprecated reasoning_content field"):
  an assistant message's ``reasoning_content`` is renamed ``reasoning`` before rendering, and the
  renderer hands it to the template as both ``reasoning`` and ``reasoning_content``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_serve.errors import InvalidRequest, UnsupportedOption
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.tokenization.hf import HfTokenizer
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.local_router import LocalRouter, start_local_router
from tests.support.tokenizer import build_tiny_tokenizer

MODEL = "narwhal-sim"
USER = {"role": "user", "content": "hi"}


def _raw(**body: Any) -> bytes:
    return json.dumps({"model": MODEL, **body}).encode()


@pytest.fixture(scope="module")
async def router() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({"admission": {"mode": "open"}, "sim": {"engines": [{"name": "u0"}]}})
    yield r
    await r.stop()


# ------------------------------------------------------------------ content parts vLLM takes


async def test_langchain_plain_string_content_part_reaches_the_engine(router: LocalRouter) -> None:
    """``HumanMessage(content=["Describe this", {"type": "image_url", ...}])`` reaches the wire from
    LangChain's ChatOpenAI with the string as it is; vLLM's renderer takes a ``str`` part as text.
    The router answered 400 "'messages.0.content.0' must be a content part object with a string
    'type'" before any engine saw it; now the engine decides (the simulator, as vLLM 0.32's request
    schema, refuses it in its own words: a 400 relayed, not the router's)."""
    msg = {"role": "user", "content": ["Describe the weather in one word.", {"type": "text", "text": "Be brief."}]}
    req = parse_request("chat", _raw(messages=[msg], max_tokens=2), model=MODEL)
    assert req.body["messages"][0]["content"] == msg["content"]  # sized, and forwarded as sent
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [msg], "max_tokens": 2})
    assert r.status_code == 400 and "engine rejected" in r.json()["error"]["message"], r.text
    sent = router.sim("u0").engine.recent[-1]["body"]
    assert sent["messages"][0]["content"] == msg["content"]


@pytest.mark.parametrize("part", [
    {"type": "image_embeds", "image_embeds": "UEsDBBQAAAAIAA=="},
    {"type": "audio_embeds", "audio_embeds": "UEsDBBQAAAAIAA=="},
], ids=["image_embeds", "audio_embeds"])
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_embedding_content_parts_are_not_refused(part: dict[str, Any], stream: bool) -> None:
    """vLLM parses ``image_embeds`` / ``audio_embeds`` parts (its own documented embedding inputs,
    on a server started with ``--enable-mm-embeds``); Narwhal refuses them, streaming or not, with
    400 ``unsupported_option`` "content part type 'image_embeds' is not supported" — for any fleet,
    whatever its engines take.  docs/contract.md ("Errors", unsupported_option) words the refusal as
    "a message content part of a type vLLM does not take"; these are types vLLM takes."""
    msg = {"role": "user", "content": [{"type": "text", "text": "What is in this image?"}, part]}
    parsed = parse_request("chat", _raw(messages=[msg], stream=stream, max_tokens=8), model=MODEL)
    assert parsed.body["messages"][0]["content"][1] == part  # forwarded as sent, for the engine to judge


def test_completion_with_prompt_embeds_is_refused_as_unsupported_not_as_a_missing_prompt() -> None:
    """vLLM's completions take ``prompt_embeds`` in place of ``prompt`` (--enable-prompt-embeds); the
    router cannot size such a prompt, so it refuses it in so many words (it answered "'prompt' is
    required", as if the client had sent nothing)."""
    with pytest.raises(UnsupportedOption) as err:
        parse_request("completion", _raw(prompt_embeds="UEsDBBQAAAAIAA==", max_tokens=8), model=MODEL)
    assert err.value.param == "prompt_embeds" and err.value.info().status == 400


# ------------------------------------------------------------------ what the engine is sent

# A template that renders an assistant turn's reasoning, as Qwen3's, GLM's and MiniMax's do
# (`reasoning_content`, which vLLM's renderer sets beside `reasoning`).
REASONING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' and m['reasoning_content'] is defined and m['reasoning_content'] %}"
    "<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def reasoning_tok(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    tok = HfTokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer")))
    tok.chat_template = REASONING_TEMPLATE
    return tok


async def test_assistant_reasoning_content_reaches_the_prompt_ids(reasoning_tok: HfTokenizer) -> None:
    """LiteLLM (and the Vercel AI SDK) send an earlier assistant turn's thinking back as
    ``reasoning_content``; vLLM 0.32 renames it ``reasoning`` before rendering, so both spellings
    give the model the same prompt.  Narwhal's renderer (tokenization/chat.py ``conversation``) reads
    ``reasoning`` only: its exact prompt IDs for the ``reasoning_content`` request leave the
    thinking out.  Those IDs size the request (the context check counts them as exact), and with
    ``serving.forward_prompt_ids: all`` they are what the engine is sent in place of the messages —
    the request's shape (forward.py ``shape_of``: roles, tool calls, parts) is the same as a request
    without reasoning, so a shape trusted on such requests sends the model a prompt without the
    thinking the client sent, silently."""
    turns = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "And 3+3?"}]

    def with_reasoning(key: str) -> bytes:
        msgs = [dict(m) for m in turns]
        msgs[1][key] = "Two plus two is four."
        return _raw(messages=msgs, max_tokens=8)

    sizer = PromptSizer(reasoning_tok)
    legacy = await sizer.size(parse_request("chat", with_reasoning("reasoning_content"), model=MODEL))
    current = await sizer.size(parse_request("chat", with_reasoning("reasoning"), model=MODEL))
    assert legacy.method == current.method == "tokenizer"
    rendered = reasoning_tok.decode(list(legacy.ids or []))
    assert "<think>Two plus two is four.</think>" in rendered, rendered
    assert legacy.ids == current.ids
