"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, from the router's own tokenizer.

``/tokenize`` takes ``prompt`` (completion rules: ``add_special_tokens`` defaults to true) or
``messages`` (chat rules: rendered with the chat template as vLLM renders it, ``add_special_tokens``
false, ``add_generation_prompt`` true, ``tools``, ``chat_template_kwargs``) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}``.  These are the IDs admission sizes the prompt with.  A router without a tokenizer
answers 404 ``tokenizer_unavailable``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from narwhal_serve.errors import InvalidRequest, NarwhalError
from narwhal_serve.protocol.requests import decode_json, model_not_found
from narwhal_serve.tokenization.chat import NotExact
from narwhal_serve.tokenization.sizer import INLINE_CHARS, PromptSizer


class TokenizerUnavailable(NarwhalError):
    status = 404
    type = "invalid_request_error"
    code = "tokenizer_unavailable"


def _tokenizer(sizer: PromptSizer) -> Any:
    if sizer.tokenizer is None:
        raise TokenizerUnavailable("This router has no tokenizer for its model: set `tokenizer:` in its config "
                                   "(a Hugging Face tokenizer directory).")
    return sizer.tokenizer


def _check_model(body: dict[str, Any], model: str) -> None:
    m = body.get("model")
    if m is not None and m != model:
        raise model_not_found(str(m), model)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"'messages.{i}' must be an object with a string 'role'", param=f"messages.{i}")
        c = m.get("content")
        if not (c is None or isinstance(c, (str, list))):
            raise InvalidRequest(f"'messages.{i}.content' must be a string, a list of parts, or null",
                                 param=f"messages.{i}.content")


async def tokenize(sizer: PromptSizer, model: str, raw: bytes) -> dict[str, Any]:
    tok = _tokenizer(sizer)
    body = decode_json(raw)
    _check_model(body, model)
    if "messages" in body:
        _check_messages(body["messages"])
        route, size = "chat", len(raw)
    else:
        p = body.get("prompt")
        if not isinstance(p, str):
            raise InvalidRequest("'prompt' (a string) or 'messages' is required", param="prompt")
        route, size = "completion", len(p)
    for key in ("add_special_tokens", "add_generation_prompt", "continue_final_message", "return_token_strs"):
        if key in body and not isinstance(body[key], bool):
            raise InvalidRequest(f"'{key}' must be a boolean", param=key)
    try:
        if size > INLINE_CHARS:
            enc = await asyncio.to_thread(tok.prompt, route, body)
        else:
            enc = tok.prompt(route, body)
    except NotExact as exc:
        raise InvalidRequest(f"cannot tokenize this request: {exc}", param=None) from None
    strs = tok.token_strs(enc.ids) if body.get("return_token_strs") else None
    return {"count": len(enc.ids), "max_model_len": tok.max_model_len, "tokens": enc.ids, "token_strs": strs}


async def detokenize(sizer: PromptSizer, model: str, raw: bytes) -> dict[str, Any]:
    tok = _tokenizer(sizer)
    body = decode_json(raw)
    _check_model(body, model)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequest("'tokens' must be a list of token ids", param="tokens")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"'tokens.{bad}' is not a token id of this model (vocabulary {tok.vocab_size})",
                             param=f"tokens.{bad}")
    return {"prompt": tok.decode(ids)}
