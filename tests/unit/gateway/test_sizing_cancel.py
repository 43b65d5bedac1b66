"""A client that leaves while its (long) prompt is being tokenized: Serve cancels the handler, and
the request is still counted — offered, unsized_offered and cancelled (client_disconnected) — so
the terminal classes add up to offered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from narwhal_serve.gateway.app import build_api
from narwhal_serve.gateway.backend import LocalBackend
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.local_router import LocalRouter, start_local_router


@pytest.fixture(scope="module")
async def local() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({"admission": {"mode": "open"},
                                  "sim": {"engines": [{"name": "u0", "role": "unified"}]}})
    yield r
    await r.stop()


class _LeavesWhileSizing(PromptSizer):
    """Tokenizing takes long, and the client leaves meanwhile (Serve cancels the handler's task)."""

    async def size(self, parsed: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(30)  # (ended by the cancellation)
        raise AssertionError("not cancelled")


async def test_a_client_gone_while_its_prompt_is_sized_is_counted(local: LocalRouter) -> None:
    app = build_api(local.cfg, LocalBackend(local.svc, local.client), sizer=_LeavesWhileSizing(None))
    before = local.svc.snapshot()["counters"]
    body = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "word " * 900}], "max_tokens": 5}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        sent = asyncio.get_running_loop().create_task(c.post("/v1/chat/completions", json=body))
        with pytest.raises(asyncio.CancelledError):
            await sent
    await app.state.reporter.flush()
    now = local.svc.snapshot()["counters"]
    moved = {k: now[k] - before[k] for k in ("offered", "unsized_offered", "cancelled")}
    assert moved == {"offered": 1, "unsized_offered": 1, "cancelled": 1}
    await app.state.reporter.stop()
