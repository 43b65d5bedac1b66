"""A client that leaves mid-stream makes the real vLLM engine abort its request: nothing keeps
running, queued or holding KV blocks after it (issue 13; the simulator's version is in tests/fault)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import E2E
from tests.e2e.helpers import body_for, leave_mid_stream, path_of, vllm_generated, wait_router_idle, wait_vllm_idle

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_a_client_leaving_mid_stream_aborts_the_vllm_request(e2e: E2E, route: str) -> None:
    # Engines as in scripts/vllm_cpu_engine.py SERVER_ENV: with vLLM's default CPU executor, its
    # streams could stall until their last token under load, and the client could not leave before
    # the end (this test failed so in CI).
    body = body_for(route, stream=True, max_tokens=480, ignore_eos=True)
    async with httpx.AsyncClient(timeout=60) as c:
        await wait_vllm_idle(c, e2e.vllm)
        before = await vllm_generated(c, e2e.vllm)
        await leave_mid_stream(c, e2e.narwhal + path_of(route), body)
        await wait_vllm_idle(c, e2e.vllm)
        generated = await vllm_generated(c, e2e.vllm) - before
        await wait_router_idle(c, e2e.narwhal)
    print(f"{route}: vLLM generated {generated:.0f} of 480 tokens before the abort")
    assert 0 < generated < 480  # vLLM stopped it: it did not run its 480 tokens to the end
