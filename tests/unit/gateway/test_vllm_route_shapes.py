"""Differential review of the vLLM-shaped routes against vLLM 0.32's own server: differences a client
written for vLLM tripped on (each refused or answered otherwise before 2026-12-06).

- vLLM's chat content parts: ``TEXT_PART_TYPES = {"text", "input_text", "output_text", "refusal",
  "thinking"}`` (vllm/renderers/chat_utils/parse_chat_message_content.py); the request schema types
  ``refusal`` (OpenAI's ``ChatCompletionContentPartRefusalParam``, valid in an assistant message by
  OpenAI's own spec) and ``thinking`` (``CustomThinkCompletionContentParam``) parts
  (vllm/renderers/chat_utils/types.py).  Narwhal's tokenizer rendered them, but the request check
  refused them, on ``/tokenize`` and on ``/v1/chat/completions`` (one set of text parts now,
  narwhal_serve/protocol/requests.py ``TEXT_PART_TYPES``).
- ``TokenizeCompletionRequest.return_token_strs: bool | None``
  (vllm/entrypoints/serve/tokenize/protocol.py).
- ``ModelCard.owned_by = "vllm"`` (vllm/entrypoints/openai/engine/protocol.py), which clients use
  to tell a vLLM server from a generic OpenAI-compatible one.

The app is built in-process (no Ray) and called through httpx's ASGITransport, as the other gateway
tests do; the chat test runs the in-process router over a simulated vLLM-dialect engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.fleetless import asgi_client, fleetless_app, tok_dir
from tests.support.local_router import LocalRouter, start_local_router

MODEL = "narwhal-sim"
USER = {"role": "user", "content": "hi"}


_app = fleetless_app
_client = asgi_client
__all__ = ["tok_dir"]  # (the fixture, shared)


@pytest.fixture(scope="module")
async def router() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({"admission": {"mode": "open"}, "sim": {"engines": [{"name": "u0"}]}})
    yield r
    await r.stop()


# ------------------------------------------------------------------------------- content parts

ASSISTANT_PARTS = {
    # OpenAI's own assistant content part (ChatCompletionAssistantMessageParam: text | refusal)
    "refusal": {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
    # vLLM's interleaved-thinking part (CustomThinkCompletionContentParam), beside a text part
    "thinking": {"role": "assistant", "content": [{"type": "thinking", "thinking": "let me see"},
                                                  {"type": "text", "text": "ok"}]},
}


@pytest.mark.parametrize("kind", sorted(ASSISTANT_PARTS))
async def test_tokenize_takes_the_text_content_parts_vllm_takes(tok_dir: Path, kind: str) -> None:
    """vLLM parses these parts as text (TEXT_PART_TYPES) and answers 200; Narwhal answered 400
    ``unsupported_option`` ("content part type 'refusal' is not supported")."""
    body = {"model": MODEL, "messages": [USER, ASSISTANT_PARTS[kind], USER]}
    async with _client(_app(tok_dir)) as c:
        r = await c.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"]) > 0


async def test_chat_completion_takes_an_assistant_refusal_part(router: LocalRouter) -> None:
    """The same check guards /v1/chat/completions: a conversation replayed with the assistant's
    refusal part (as OpenAI's SDK types it) is served by vLLM and refused by Narwhal before any
    engine sees it."""
    body = {"model": MODEL, "messages": [USER, ASSISTANT_PARTS["refusal"], USER], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------ /tokenize

async def test_tokenize_takes_return_token_strs_null(tok_dir: Path) -> None:
    """vLLM: ``return_token_strs: bool | None = False``; null is no token strings.  Narwhal: 400
    "'return_token_strs' must be a boolean"."""
    async with _client(_app(tok_dir)) as c:
        r = await c.post("/tokenize", json={"model": MODEL, "prompt": "hello", "return_token_strs": None})
    assert r.status_code == 200, r.text
    assert r.json()["token_strs"] is None and r.json()["count"] == len(r.json()["tokens"])


# ------------------------------------------------------------------------------------ /v1/models

async def test_model_card_owned_by_is_vllms_for_a_vllm_fleet(tok_dir: Path) -> None:
    """vLLM's ModelCard says ``owned_by: "vllm"``; clients tell a vLLM server from a generic
    OpenAI-compatible one by it (``any(m["owned_by"] == "vllm" for m in data)``) and only then use
    vLLM's extras (/tokenize, guided decoding, ...).  Narwhal fronting a vLLM fleet says
    ``"narwhal"`` (not in the contract's /v1/models row)."""
    async with _client(_app(tok_dir)) as c:
        card = (await c.get("/v1/models")).json()["data"][0]
    assert card["owned_by"] == "vllm", card
