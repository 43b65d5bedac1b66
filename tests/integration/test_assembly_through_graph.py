"""Issue 4 through the graph: every assembly row (scripted by the simulator), streaming and assembled
answers agreeing field by field, 502 rules, token-ID failures retried before headers, stream errors
after headers, usage computed when the engine omits it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from collections.abc import AsyncIterator

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.server import SimServer, start_server
from tests.integration.conftest import ADMIN, MODEL, Graph
from tests.integration.helpers import AUTH, wait_status
from tests.support.net import free_port

CHAT = "/v1/chat/completions"


def body(*, stream: bool, script: str | None = None, fault: str | None = None, **kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "assemble me"}], "max_tokens": 6,
                         "seed": 7, "stream": stream, **kw}
    sim: dict[str, Any] = {}
    if script:
        sim["script"] = script
    if fault:
        sim["fault"] = fault
    if sim:
        b["sim"] = sim
    return b


def sse_chunks(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert text.rstrip().endswith("data: [DONE]")
    return out


def fold_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A deliberately naive client-side fold, independent of narwhal_serve.assembly."""
    msg: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    ids: list[int] = []
    finish = None
    for ch in chunks:
        for c in ch.get("choices", []):
            d = c.get("delta", {})
            for k in ("content", "reasoning", "reasoning_content", "refusal"):
                if d.get(k):
                    msg[k] = msg.get(k, "") + d[k]
            for tc in d.get("tool_calls") or []:
                cur = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                cur["id"] += tc.get("id") or ""
                cur["name"] += (tc.get("function") or {}).get("name") or ""
                cur["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            if d.get("function_call"):
                fc = msg.setdefault("function_call", {"name": "", "arguments": ""})
                fc["name"] += d["function_call"].get("name") or ""
                fc["arguments"] += d["function_call"].get("arguments") or ""
            ids += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": msg, "token_ids": ids, "finish_reason": finish}


def normalise(full: dict[str, Any]) -> dict[str, Any]:
    c = full["choices"][0]
    m = c["message"]
    msg = {k: m[k] for k in ("content", "reasoning", "reasoning_content", "refusal") if m.get(k)}
    if m.get("tool_calls"):
        msg["tool_calls"] = [{"id": t["id"], "name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                             for t in m["tool_calls"]]
    if m.get("function_call"):
        msg["function_call"] = m["function_call"]
    return {"message": msg, "token_ids": c.get("token_ids") or [], "finish_reason": c["finish_reason"]}


@pytest.mark.parametrize("script", [None, "reasoning", "reasoning_content", "tool_calls", "refusal", "function_call"])
async def test_streamed_and_assembled_agree(graph: Graph, script: str | None) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        full = await c.post(CHAT, json=body(stream=False, script=script, return_token_ids=True))
        streamed = await c.post(CHAT, json=body(stream=True, script=script, return_token_ids=True))
    assert full.status_code == 200, full.text
    assert streamed.status_code == 200
    got = normalise(full.json())
    assert got == fold_stream(sse_chunks(streamed.text))
    key = {None: "content", "reasoning": "reasoning", "reasoning_content": "reasoning_content",
           "tool_calls": "tool_calls", "refusal": "refusal", "function_call": "function_call"}[script]
    assert got["message"].get(key), got
    if script == "tool_calls":
        calls = full.json()["choices"][0]["message"]["tool_calls"]
        assert [t["type"] for t in calls] == ["function"] * len(calls) and len(calls) == 2
        assert full.json()["choices"][0]["finish_reason"] == "tool_calls"
    usage = full.json()["usage"]
    assert usage["completion_tokens"] == len(got["token_ids"]) > 0


@pytest.mark.parametrize("fault,param", [("unsupported_field", "audio"), ("tool_call_no_id", "id")])
async def test_502_rules(graph: Graph, fault: str, param: str) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post(CHAT, json=body(stream=False, fault=fault))
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("upstream_error", "bad_engine_response")
    assert param in err["message"]


@pytest.fixture
async def extra_engine(graph: Graph) -> AsyncIterator[SimServer]:
    """A second unified engine, run in this process and registered in the tight app at run time."""
    srv = await start_server(SimEngineConfig(name="tight-extra", model=MODEL), "127.0.0.1", free_port())
    spec = {"name": "tight-extra", "url": srv.url, "role": "unified", "dialect": "vllm"}
    async with httpx.AsyncClient(base_url=graph.tight_url, timeout=30, headers=ADMIN) as c:
        assert (await c.post("/admin/engines", json=spec)).status_code == 200
        try:
            await wait_status(graph.tight_url, lambda s: any(e["name"] == "tight-extra" and e["eligible"] for e in s["engines"]),
                              "the extra engine to be eligible")
            yield srv
        finally:
            await c.request("DELETE", "/admin/engines", json={"name": "tight-extra"})
            await srv.stop()


@pytest.mark.parametrize("fault", ["bad_token_ids", "missing_token_ids", "negative_token_ids", "error_500", "malformed_sse"])
async def test_failures_before_headers_are_retried_on_another_route(graph: Graph, extra_engine: SimServer, fault: str) -> None:
    """The extra engine fails every request at its first token. Placement spreads requests over both
    engines, so some try it first: each of those is retried before headers and still succeeds."""
    retried = {False: 0, True: 0}  # by stream mode: requests that hit the failing engine first
    async with httpx.AsyncClient(timeout=30) as c:
        await c.post(extra_engine.url + "/sim/control", json={"faults": [fault]})
        for i in range(24):  # bounded: stop once both modes were retried
            stream = (i // 2) % 2 == 1  # F F T T …: each mode meets both rotation parities
            before = extra_engine.engine.total_requests
            # fault_after 0: the engine's first generated token is already bad
            r = await c.post(graph.tight_url + CHAT, headers=AUTH,
                             json={**body(stream=stream, max_tokens=3), "sim": {"fault_after": 0}})
            assert r.status_code == 200, r.text
            if stream:
                assert '"error"' not in r.text and r.text.rstrip().endswith("data: [DONE]")
            retried[stream] += extra_engine.engine.total_requests > before
            if all(retried.values()):
                break
    assert all(retried.values()), f"the failing engine was not tried first in both modes: {retried}"


async def test_bad_token_ids_everywhere_is_a_502(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post(CHAT, json=body(stream=False, fault="bad_token_ids"))
    assert r.status_code == 502 and r.json()["error"]["code"] == "bad_engine_response"
    assert "token_ids" in r.json()["error"]["message"]


async def test_failure_after_headers_ends_stream_with_error_event(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post(CHAT, json={**body(stream=True, max_tokens=8), "sim": {"fault": "reset_mid_stream", "fault_after": 3}})
    assert r.status_code == 200
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert err["code"] == "bad_engine_response" and err["type"] == "upstream_error"
    assert len(lines) >= 3  # some content was relayed before the failure


async def test_usage_computed_when_engine_omits_it(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post(CHAT, json=body(stream=False, fault="missing_usage", return_token_ids=True))
        s = await c.post(CHAT, json=body(stream=True, fault="missing_usage", stream_options={"include_usage": True}))
    assert r.status_code == 200, r.text
    full = r.json()
    ids = full["choices"][0]["token_ids"]
    assert full["usage"]["completion_tokens"] == len(ids) > 0
    assert full["usage"]["prompt_tokens"] == len(full["prompt_token_ids"])
    assert s.status_code == 200 and s.text.rstrip().endswith("data: [DONE]")
