"""The dialect contract: how one kind of engine is asked for a completion.

One module per dialect (``vllm``, ``sglang``, ``openai``) implements :class:`Dialect`; the relay
never branches on the dialect's name.
"""

from __future__ import annotations

from typing import Any, Protocol

from narwhal_serve.protocol.requests import ParsedRequest

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class Dialect(Protocol):
    name: str
    supports_token_ids: bool
    supports_pd: bool
    takes_prompt_ids: bool  # the prompt may go as the router's token IDs (tokenization/forward.py)
    # a non-streaming chat message's content when a forced tool call (protocol/requests.py
    # forces_tool) streamed none: the engine's own non-streaming answer's (assembly/fold.py)
    forced_tool_content: str | None

    def decode_body(self, req: ParsedRequest, kv_transfer_params: Any = None) -> dict[str, Any]:
        """The body of the leg whose stream reaches the client."""
        ...


def streaming_body(req: ParsedRequest, *, counts_from_ids: bool = False) -> dict[str, Any]:
    """The client's body as a streaming request.

    It asks for the usage frame whenever the router needs it: for assembly (non-streaming
    clients), when the client asked, and when output can only be counted from usage (no token
    IDs).  Otherwise it leaves the client's choice alone, so the engine keeps putting
    ``system_fingerprint`` on the final choice chunk as it does for a plain stream.
    """
    body = dict(req.body)
    body["stream"] = True
    if not req.stream or req.include_usage or not counts_from_ids:
        so = dict(body.get("stream_options") or {})
        so["include_usage"] = True
        body["stream_options"] = so
    return body
