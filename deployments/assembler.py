"""Assembler deployment: opens engine streams for placed requests and relays or assembles them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from narwhal_serve.config import ObservabilityConfig
from narwhal_serve.engines.client import engine_client
from narwhal_serve.observability import Tracing
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay


class Assembler:
    def __init__(
        self,
        engine_http: Literal["aiohttp", "httpx"] = "aiohttp",
        engine_idle_timeout_s: float = 60.0,
        observability: dict[str, Any] | None = None,
    ) -> None:
        tracing = Tracing(ObservabilityConfig.model_validate(observability or {}))
        self.relay = Relay(engine_client(engine_http), idle_timeout_s=engine_idle_timeout_s, tracing=tracing)

    async def run(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        async for msg in self.relay.run(placed):
            yield msg
