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

    def decode_body(self, req: ParsedRequest, kv_transfer_params: Any = None) -> dict[str, Any]:
        """The body of the leg whose stream reaches the client."""
        ...


def streaming_body(req: ParsedRequest) -> dict[str, Any]:
    """The client's body as a streaming request that always ends with a usage frame."""
    body = dict(req.body)
    body["stream"] = True
    so = dict(body.get("stream_options") or {})
    so["include_usage"] = True
    body["stream_options"] = so
    return body
