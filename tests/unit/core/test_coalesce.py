"""The coalescing reader: everything already read goes out as one batch, nothing waits to fill one,
errors and early closes reach the engine stream."""

import asyncio
from collections.abc import AsyncGenerator

import pytest

from narwhal_serve.relay.coalesce import coalesce


async def test_piled_up_reads_go_out_together_and_a_lone_read_alone() -> None:
    go, gate = asyncio.Event(), asyncio.Event()

    async def source() -> AsyncGenerator[list[int], None]:
        yield [1]
        await go.wait()
        for i in range(2, 6):
            yield [i]
        await gate.wait()
        yield [6]

    out = coalesce(source())
    assert await asyncio.wait_for(out.__anext__(), 5) == [1]
    go.set()
    await asyncio.sleep(0.01)  # the reader piles up 2..5 while nobody consumes
    assert await asyncio.wait_for(out.__anext__(), 5) == [2, 3, 4, 5]
    gate.set()
    assert await asyncio.wait_for(out.__anext__(), 5) == [6]  # alone: nothing else was waiting
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(out.__anext__(), 5)


async def test_an_engine_error_reaches_the_consumer_after_what_was_read() -> None:
    async def source() -> AsyncGenerator[list[int], None]:
        yield [1]
        raise ValueError("broken stream")

    got: list[int] = []
    with pytest.raises(ValueError, match="broken stream"):
        async for batch in coalesce(source()):
            got.extend(batch)
    assert got == [1]


async def test_closing_early_closes_the_engine_stream() -> None:
    closed = asyncio.Event()

    async def source() -> AsyncGenerator[list[int], None]:
        try:
            i = 0
            while True:
                i += 1
                yield [i]
        finally:
            closed.set()

    out = coalesce(source(), max_pending=4)  # bounded: the reader blocks, it does not buffer on
    assert (await out.__anext__())[0] == 1
    await out.aclose()
    assert closed.is_set()
