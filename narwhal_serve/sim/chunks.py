"""Builders of stream chunks and non-stream bodies, key for key as vLLM 0.32 serializes them.

See ``tests/fixtures/vllm-0.32.0-cpu``: the chat role chunk carries top-level ``prompt_token_ids`` and
``prompt_text``; content chunks carry ``choices[0].token_ids``; ``stop_reason`` appears on the finish
chunk only; ``system_fingerprint`` goes on the usage chunk when there is one, else the finish chunk.
Completion chunks carry every choice key on every chunk (``prompt_token_ids`` non-null on the first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from narwhal_serve.sim.scripts import Output, Step, assemble_message, step_delta
from narwhal_serve.sim.textgen import GenToken

# Keys vLLM adds to OpenAI's shapes; dialect "openai" drops them.
_VLLM_ONLY = ("prompt_token_ids", "prompt_text", "token_ids", "stop_reason", "routed_experts",
              "prompt_logprobs", "kv_transfer_params", "ec_transfer_params", "metrics")
_TOKEN_ID_KEYS = ("prompt_token_ids", "token_ids")


@dataclass(frozen=True)
class Shape:
    """Everything about a request that decides the shape of its chunks/body."""

    kind: Literal["chat", "completion"]
    rid: str
    created: int
    model: str
    fingerprint: str
    prompt_ids: list[int]
    want_ids: bool
    logprobs: int | None
    """Chat: ``top_logprobs`` (0 if absent) when ``logprobs`` is true; completion: ``logprobs``."""
    include_usage: bool
    dialect: str
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    # streamed text held back while a stop string may be starting: the longest stop string less
    # one, when stop strings are cut from the output (vLLM 0.32 v1/engine/detokenizer.py
    # ``stop_buffer_length``), sent with the finish
    holdback: int = 0

    @property
    def object(self) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk"
        return "text_completion"

    def head(self, obj: str | None = None) -> dict[str, Any]:
        return {"id": self.rid, "object": obj or self.object, "created": self.created, "model": self.model}


def _lp_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprob(tok: GenToken, k: int) -> dict[str, Any]:
    tops = [(tok.token, tok.logprob), *tok.top][:k]
    return {**_lp_entry(tok.token, tok.logprob), "top_logprobs": [_lp_entry(t, lp) for t, lp in tops]}


def completion_top(tok: GenToken, k: int) -> dict[str, float]:
    return dict([(tok.token, tok.logprob), *tok.top[:k]])


def completion_logprobs(tokens: list[GenToken], offsets: list[int], k: int) -> dict[str, Any]:
    return {
        "text_offset": offsets,
        "token_logprobs": [t.logprob for t in tokens],
        "tokens": [t.token for t in tokens],
        "top_logprobs": [completion_top(t, k) for t in tokens],
    }


def adapt(obj: dict[str, Any], sh: Shape) -> dict[str, Any]:
    """Dialect post-processing: ``openai`` drops vLLM-only keys; ``sglang`` drops token-id keys
    unless asked for and the KV-transfer keys."""
    if sh.dialect == "vllm":
        return obj
    drop: tuple[str, ...] = _VLLM_ONLY if sh.dialect == "openai" else ("kv_transfer_params", "ec_transfer_params")
    if sh.dialect == "sglang" and not sh.want_ids:
        drop += _TOKEN_ID_KEYS
    for d in (obj, *obj.get("choices", [])):
        for key in drop:
            d.pop(key, None)
    if sh.dialect == "openai":
        for ch in obj.get("choices", []):
            msg = ch.get("message")
            if isinstance(msg, dict):
                for key in ("annotations", "audio", "function_call", "reasoning"):
                    if msg.get(key) is None:
                        msg.pop(key, None)
    return obj


# ---- streaming ---------------------------------------------------------------------------------


def chat_role_chunk(sh: Shape) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    chunk = {**sh.head(), "choices": [choice], "prompt_token_ids": sh.prompt_ids if sh.want_ids else None,
             "prompt_text": None}
    return adapt(chunk, sh)


def _finish_fields(choice: dict[str, Any], finish: tuple[str, str | None] | None) -> None:
    choice["finish_reason"] = finish[0] if finish else None
    if finish:
        choice["stop_reason"] = finish[1]


def chat_step_chunk(sh: Shape, step: Step, finish: tuple[str, str | None] | None) -> dict[str, Any]:
    logprobs = None if sh.logprobs is None else {"content": [chat_logprob(step.token, sh.logprobs)]}
    choice: dict[str, Any] = {"index": 0, "delta": step_delta(step), "logprobs": logprobs}
    _finish_fields(choice, finish)
    choice["token_ids"] = [step.token.token_id] if sh.want_ids else None
    chunk = {**sh.head(), "choices": [choice]}
    if finish and not sh.include_usage:
        chunk["system_fingerprint"] = sh.fingerprint
    return adapt(chunk, sh)


def completion_step_chunk(
    sh: Shape, step: Step, first: bool, offset: int, finish: tuple[str, str | None] | None
) -> dict[str, Any]:
    tok = step.token
    logprobs = None if sh.logprobs is None else completion_logprobs([tok], [offset], sh.logprobs)
    choice: dict[str, Any] = {"index": 0, "text": step.text, "logprobs": logprobs}
    choice["finish_reason"] = finish[0] if finish else None
    choice["stop_reason"] = finish[1] if finish else None
    choice["prompt_token_ids"] = sh.prompt_ids if (first and sh.want_ids) else None
    choice["token_ids"] = [tok.token_id] if sh.want_ids else None
    chunk = {**sh.head(), "choices": [choice]}
    if finish and not sh.include_usage:
        chunk["system_fingerprint"] = sh.fingerprint
    return adapt(chunk, sh)


def with_running_usage(sh: Shape, chunk: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
    """A chunk with the usage so far, when the client asked for it on every chunk (vLLM 0.32: the
    chat's role chunk with 0 completion tokens, then each chunk's count so far; a chat's carries
    ``completion_tokens_details``: null)."""
    if sh.continuous_usage:
        p = len(sh.prompt_ids)
        usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": completion_tokens,
                                 "total_tokens": p + completion_tokens}
        if sh.kind == "chat":
            usage["completion_tokens_details"] = None
        chunk["usage"] = usage
    return chunk


def usage_chunk(sh: Shape, completion_tokens: int) -> dict[str, Any]:
    p = len(sh.prompt_ids)
    usage = {"prompt_tokens": p, "total_tokens": p + completion_tokens, "completion_tokens": completion_tokens}
    return {**sh.head(), "choices": [], "usage": usage, "system_fingerprint": sh.fingerprint}


# ---- non-stream --------------------------------------------------------------------------------


def _usage(sh: Shape, completion_tokens: int) -> dict[str, Any]:
    p = len(sh.prompt_ids)
    return {"prompt_tokens": p, "total_tokens": p + completion_tokens, "completion_tokens": completion_tokens,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def chat_response(sh: Shape, out: Output, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    toks = [s.token for s in out.steps]
    logprobs = None if sh.logprobs is None else {"content": [chat_logprob(t, sh.logprobs) for t in toks]}
    choice = {
        "index": 0,
        "message": assemble_message(out),
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "token_ids": out.token_ids if sh.want_ids else None,
        "routed_experts": None,
    }
    body = {
        **sh.head("chat.completion"),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": sh.fingerprint,
        "usage": _usage(sh, len(toks)),
        "prompt_logprobs": None,
        "prompt_token_ids": sh.prompt_ids if sh.want_ids else None,
        "prompt_text": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }
    return adapt(body, sh)


def completion_response(sh: Shape, out: Output, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    toks = [s.token for s in out.steps]
    offsets, pos = [], 0
    for s in out.steps:
        offsets.append(pos)
        pos += len(s.text)
    choice = {
        "index": 0,
        "text": "".join(s.text for s in out.steps),
        "logprobs": None if sh.logprobs is None else completion_logprobs(toks, offsets, sh.logprobs),
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "token_ids": out.token_ids if sh.want_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": sh.prompt_ids if sh.want_ids else None,
        "routed_experts": None,
    }
    body = {
        **sh.head("text_completion"),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": sh.fingerprint,
        "usage": _usage(sh, len(toks)),
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }
    return adapt(body, sh)
