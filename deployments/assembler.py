"""Assembler deployment (``deployment.relay: assembler``): opens engine streams for placed requests
and relays or assembles them, a streaming Ray hop away from the ingress."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from deployments.logs import to_serve_log
from narwhal_serve.config import ObservabilityConfig, ServingConfig
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import relay_of
from narwhal_serve.tokenization.sizer import tokenizer_at


class Assembler:
    def __init__(
        self,
        engine_http: Literal["aiohttp", "httpx"] = "aiohttp",
        serving: dict[str, Any] | None = None,
        observability: dict[str, Any] | None = None,
        tokenizer: str | None = None,
    ) -> None:
        to_serve_log()
        self.relay = relay_of(engine_http, ServingConfig.model_validate(serving or {}),
                              ObservabilityConfig.model_validate(observability or {}))
        # the served model's tokenizer (tokenization/sizer.py tokenizer_path, as the ingress loads it):
        # where a resumed answer's cut character starts (relay/resume.py Transcript.settle)
        tok = tokenizer_at(tokenizer)
        if tok is not None:
            self.relay.detokenize = tok.decode

    async def run(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        async for msg in self.relay.run(placed):
            yield msg
