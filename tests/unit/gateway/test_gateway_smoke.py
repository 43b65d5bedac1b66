from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.local_router import LocalRouter, start_local_router


@pytest.fixture(scope="module")
async def router() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({"admission": {"mode": "open"}})
    yield r
    await r.stop()


async def test_chat_roundtrip(router: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        print(r.status_code, r.text)
        assert r.status_code == 200
        r = await c.post("/v1/chat/completions", json={"model": "narwhal-sim", "stream": True, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        print(r.status_code, r.text)
        assert r.status_code == 200
