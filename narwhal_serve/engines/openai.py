"""Plain OpenAI-compatible servers: no token IDs, no P/D."""

from __future__ import annotations

from typing import Any

from narwhal_serve.engines.dialect import streaming_body
from narwhal_serve.protocol.requests import ParsedRequest


class OpenAIDialect:
    name = "openai"
    supports_token_ids = False
    takes_prompt_ids = False
    forced_tool_content: str | None = None
    supports_pd = False

    def decode_body(self, req: ParsedRequest, kv_transfer_params: Any = None) -> dict[str, Any]:
        body = streaming_body(req)
        body.pop("return_token_ids", None)
        return body


OPENAI = OpenAIDialect()
