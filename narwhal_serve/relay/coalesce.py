"""Coalescing an engine stream for the one streaming hop to the ingress.

A reader task pulls the engine's chunk batches into a bounded queue; the consumer gets everything
already read as one batch.  It never waits to fill a batch (no added inter-token latency): when the
hop is fast, each engine read goes out alone; when the hop lags, the reads that piled up go out
together, as one message instead of many.  The bound keeps per-stream memory fixed: a slow consumer
slows the engine reads down (TCP backpressure to the engine) instead of buffering without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import TypeVar

T = TypeVar("T")
MAX_PENDING = 64  # engine reads held per stream


class _End:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc


async def coalesce(source: AsyncGenerator[list[T], None], max_pending: int = MAX_PENDING) -> AsyncGenerator[list[T], None]:
    queue: asyncio.Queue[list[T] | _End] = asyncio.Queue(max_pending)

    async def read() -> None:
        try:
            async for batch in source:
                await queue.put(batch)
        except Exception as exc:  # handed to the consumer, raised there
            await queue.put(_End(exc))
            return
        await queue.put(_End(None))

    reader = asyncio.ensure_future(read())
    try:
        while True:
            item = await queue.get()
            out: list[T] = []
            end: _End | None = None
            while True:
                if isinstance(item, _End):
                    end = item
                    break
                out.extend(item)
                try:
                    item = queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
            if out:
                yield out
            if end is not None:
                if end.exc is not None:
                    raise end.exc
                return
    finally:
        if not reader.done():
            reader.cancel()
        with contextlib.suppress(BaseException):
            await reader
        await source.aclose()


