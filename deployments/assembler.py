"""Assembler deployment: opens engine streams for placed requests and relays or assembles them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay


def engine_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
    )


class Assembler:
    def __init__(self) -> None:
        self.relay = Relay(engine_client())

    async def run(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        async for msg in self.relay.run(placed):
            yield msg
