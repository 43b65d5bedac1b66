"""A client that leaves mid-stream makes the real vLLM engine abort its request: nothing keeps
running, queued or holding KV blocks after it (issue 13; the simulator's version is in tests/fault)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import E2E
from tests.e2e.helpers import body_for, leave_mid_stream, path_of, wait_router_idle, wait_vllm_idle

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_a_client_leaving_mid_stream_aborts_the_vllm_request(e2e: E2E, route: str) -> None:
    body = body_for(route, stream=True, max_tokens=400, ignore_eos=True)
    async with httpx.AsyncClient(timeout=60) as c:
        await wait_vllm_idle(c, e2e.vllm)
        await leave_mid_stream(c, e2e.narwhal + path_of(route), body, [e2e.vllm])
        await wait_vllm_idle(c, e2e.vllm)  # vLLM aborted it: 400 tokens would take seconds more
        await wait_router_idle(c, e2e.narwhal)
