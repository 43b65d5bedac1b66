"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, from the router's own tokenizer.

``/tokenize`` takes ``prompt`` (completion rules: ``add_special_tokens`` defaults to true) or
``messages`` (chat rules: rendered with the chat template as vLLM renders it, ``add_special_tokens``
false, ``add_generation_prompt`` true, ``tools``, ``chat_template_kwargs``) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}``.  These are the IDs admission sizes the prompt with.  A router without a tokenizer
answers 404 ``tokenizer_unavailable``.
"""

from __future__ import annotations

from typing import Any

from narwhal_serve.errors import InvalidRequest, NarwhalError
from narwhal_serve.protocol.options import check_rendering, lax_bools
from narwhal_serve.protocol.requests import check_messages, check_model, whole_ids
from narwhal_serve.protocol.strictjson import decode_json
from narwhal_serve.tokenization.chat import NotExact
from narwhal_serve.tokenization.sizer import PromptSizer, Tokenizer, outside_vocabulary


class TokenizerUnavailable(NarwhalError):
    status = 404
    type = "invalid_request_error"
    code = "tokenizer_unavailable"


def _tokenizer(sizer: PromptSizer) -> Tokenizer:
    if sizer.tokenizer is None:
        raise TokenizerUnavailable("This router has no tokenizer for its model: set `tokenizer:` in its config "
                                   "(a Hugging Face tokenizer directory).")
    return sizer.tokenizer


# What vLLM 0.32's /tokenize does not read (entrypoints/serve/tokenize/protocol.py: neither request
# has these fields, and extra fields go unread), though its chat and completion routes do
_UNREAD = ("documents", "reasoning_effort", "truncate_prompt_tokens")


def _as_vllm_reads(body: dict[str, Any]) -> dict[str, Any]:
    """The request as vLLM's /tokenize reads it: without the fields above, and an assistant turn's
    ``reasoning_content`` unread (only its chat route takes it as ``reasoning``)."""
    out = {k: v for k, v in body.items() if k not in _UNREAD}
    if isinstance(out.get("messages"), list):
        out["messages"] = [{k: v for k, v in m.items() if k != "reasoning_content"}
                           if isinstance(m, dict) and m.get("role") == "assistant" else m for m in out["messages"]]
    return out


async def tokenize(sizer: PromptSizer, model: str, raw: bytes) -> dict[str, Any]:
    tok = _tokenizer(sizer)
    body = decode_json(raw)
    check_model(body, model)
    body = _as_vllm_reads(body)
    if "messages" in body:
        check_messages(body)
        check_rendering(body)
        route, size = "chat", len(raw)
    else:
        p = body.get("prompt")
        if not isinstance(p, str):
            raise InvalidRequest("'prompt' (a string) or 'messages' is required", param="prompt")
        route, size = "completion", len(p)
    lax_bools(body, ("add_special_tokens", "return_token_strs"), nullable=("return_token_strs",))  # (chats: above too)
    try:
        enc = await sizer.encode(route, body, size)
    except NotExact as exc:
        raise InvalidRequest(f"cannot tokenize this request: {exc}", param=None) from None
    strs = tok.token_strs(enc.ids) if body.get("return_token_strs") else None
    return {"count": len(enc.ids), "max_model_len": tok.max_model_len, "tokens": enc.ids, "token_strs": strs}


async def detokenize(sizer: PromptSizer, model: str, raw: bytes) -> dict[str, Any]:
    tok = _tokenizer(sizer)
    body = decode_json(raw)
    check_model(body, model)
    ids = body.get("tokens")
    if isinstance(ids, list):
        ids = whole_ids(ids)  # (as the completions route takes a token-ID prompt, and vLLM's schema)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequest("'tokens' must be a list of token ids", param="tokens")
    bad = outside_vocabulary(ids, tok.vocab_size)
    if bad is not None:
        raise InvalidRequest(f"'tokens.{bad}' is not a token id of this model (vocabulary {tok.vocab_size})",
                             param=f"tokens.{bad}")
    return {"prompt": tok.decode(ids)}
