"""(Found by a hostile probe.) Admin answers that said more than they did: ``/admin/state active``
during a drain answered ``ok`` and changed nothing (a drain stops admitting for good), and a bad
``/admin/engines`` body answered pydantic's dump."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.local_router import LocalRouter, start_local_router
from tests.support.ray_env import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def router(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalRouter]:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    r = await start_local_router({"admission": {"mode": "open"}, "sim": {"engines": [{"name": "u", "role": "unified"}]}})
    yield r
    await r.stop()


async def test_a_draining_router_is_not_made_active_again(router: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        assert (await c.post("/admin/state", json={"mode": "standby"}, headers=ADMIN)).status_code == 200
        assert (await c.post("/admin/state", json={"mode": "active"}, headers=ADMIN)).status_code == 200
        assert (await c.post("/admin/drain", json={"grace_s": 5}, headers=ADMIN)).status_code == 200
        r = await c.post("/admin/state", json={"mode": "active"}, headers=ADMIN)
        assert r.status_code == 400 and "draining" in r.json()["error"]["message"], r.text
        assert (await c.get("/ready")).json()["reason"] == "draining"


async def test_a_bad_engine_body_is_answered_in_a_sentence(router: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        for body, words in (({"name": "x"}, "body: Input should be a valid dictionary"),
                            ({"name": "x", "url": "http://127.0.0.1:1", "role": "bogus"}, "role: Input should be")):
            r = await c.post("/admin/engines", json=body, headers=ADMIN)
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert words in message and "pydantic.dev" not in message and "[type=" not in message, message
