"""vLLM dialect (docs/contract.md, "Engine dialects and token identity"): token IDs on every chunk, P/D by the two-step kv_transfer_params protocol."""

from __future__ import annotations

from typing import Any

from narwhal_serve.engines.dialect import streaming_body
from narwhal_serve.protocol.requests import ParsedRequest, hides_reasoning

# The prefill leg's request to a vLLM engine with a KV connector (NixlConnector and friends).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# What a client's body may not carry to a vLLM engine: the KV and encoder-cache connectors' own
# parameters (a client's top-level kv_transfer_params is replaced or dropped below). vLLM also reads
# them from ``vllm_xargs`` (its SamplingParams.extra_args) when the request's own are unset, and a
# value there is never the dict the connector expects: one such request ended the engine core
# (AttributeError in its scheduler) for every user.  And ``kv_cache_report_mode``: "full" has the
# engine announce every prefix-cache hit's blocks again as stored (vllm/v1/core/kv_cache_manager.py),
# which the router's KV-event index counts as more copies: a block evicted once stayed in it for
# good, the engine credited with that prefix — one client skewing placement for everyone.
_XARGS_DROPPED = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")


def client_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without what a client may not send an engine: the connectors' parameters and the KV
    events' report mode (above),
    and ``prompt_logprobs`` (only null or 0 pass the parse): vLLM streams none back (a completion's
    only with ``echo``, which is refused), and any value makes it skip its prefix cache — and, on a
    P/D decode engine, the KV the prefill engine sent, prefilling the prompt a second time. Every
    request Narwhal sends a vLLM engine passes here: the legs, and a resume's continuation."""
    body.pop("ec_transfer_params", None)
    body.pop("prompt_logprobs", None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and any(k in xargs for k in _XARGS_DROPPED):
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in _XARGS_DROPPED}
    return body


class VLLMDialect:
    name = "vllm"
    supports_token_ids = True
    supports_pd = True
    takes_prompt_ids = True
    forced_tool_content: str | None = ""  # (chat_completion/serving.py: ``content=content or ""`` for a named or required tool)

    def decode_body(self, req: ParsedRequest, kv_transfer_params: Any = None) -> dict[str, Any]:
        body = client_body(streaming_body(req, counts_from_ids=not hides_reasoning(req)))
        body["return_token_ids"] = True
        body["stream_interval"] = 1
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params  # copied verbatim: opaque to the router
        else:
            body.pop("kv_transfer_params", None)
        return body

    def prefill_body(self, req: ParsedRequest) -> dict[str, Any]:
        body = client_body(dict(req.body))
        for key in ("stream_options", "min_tokens", "max_completion_tokens"):
            body.pop(key, None)
        body["stream"] = False
        body["max_tokens"] = 1
        body["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
        return body

    def with_prompt_ids(self, body: dict[str, Any], route: str, ids: "tuple[int, ...]") -> dict[str, Any]:
        """``body`` asking for the prompt as token IDs (tokenization/forward.py): a completion's
        ``prompt`` is the IDs; a chat's go as ``kv_transfer_params.prompt_token_ids``, beside what a
        P/D prefill leg's answer put there (vLLM takes the key out before the KV connector sees it)."""
        if route == "completion":
            body["prompt"] = list(ids)
            return body
        kvp = body.get("kv_transfer_params")
        if kvp is None or isinstance(kvp, dict):  # (an engine's odd kv_transfer_params is passed on as it came)
            body["kv_transfer_params"] = {**(kvp or {}), "prompt_token_ids": list(ids)}
        return body


VLLM = VLLMDialect()
