"""SGLang dialect: P/D by bootstrap — the same body plus bootstrap fields to both legs at once."""

from __future__ import annotations

import secrets
from typing import Any
from urllib.parse import urlsplit

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.dialect import streaming_body
from narwhal_serve.protocol.requests import ParsedRequest

DEFAULT_BOOTSTRAP_PORT = 8998


class SGLangDialect:
    name = "sglang"
    supports_token_ids = False
    takes_prompt_ids = False
    forced_tool_content: str | None = None  # (serving_chat.py: ``content=text if text else None``)
    supports_pd = True

    def decode_body(self, req: ParsedRequest, kv_transfer_params: Any = None) -> dict[str, Any]:
        body = streaming_body(req)
        if isinstance(kv_transfer_params, dict):
            body.update(kv_transfer_params)  # the bootstrap fields shared with the prefill leg
        return body

    def bootstrap_fields(self, prefill: EngineConfig) -> dict[str, Any]:
        host = urlsplit(prefill.url).hostname or "127.0.0.1"
        if ":" in host:  # IPv6, bracketed as SGLang's own balancer sends it (its decode engine joins host:port)
            host = f"[{host}]"
        return {
            "bootstrap_host": host,
            "bootstrap_port": prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
            "bootstrap_room": secrets.randbits(63),
        }

    def prefill_body(self, req: ParsedRequest, bootstrap: dict[str, Any]) -> dict[str, Any]:
        body = dict(req.body)
        body.pop("stream_options", None)
        body["stream"] = False
        body.update(bootstrap)
        return body


SGLANG = SGLangDialect()
