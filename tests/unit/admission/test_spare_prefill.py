"""P/D routes pair every decode engine with the least loaded prefill engine of their dialect; a
placement's routes still hold a way past that prefill engine when another is eligible (found by a
differential review against vLLM 0.32's own P/D proxy, which picks the prefill engine apart from the
decode one: before, a prefill engine's 5xx or busy 503 ended the request while a second prefill
engine sat idle, as the relay leaves a failed engine out of every later route)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.config import EngineConfig
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.pipeline import Relay
from tests.support.sse import sse_response
from tests.unit.admission.test_overload_decisions import NOW, engine, view


def _leg(name: str, role: str, inflight: int = 0, dialect: str = "vllm") -> Any:
    cfg = EngineConfig(name=name, url=f"http://{name}", role=role, dialect=dialect)
    return engine(name, cfg=cfg, inflight=inflight)


def _placed(*engines: Any, predictive: bool = True) -> Placement:
    v = view(*engines) if predictive else view(*engines).__class__(engines=engines, unavailable=None,
                                                                    predictive=False)
    out = decide(v, Ask(100, 30.0), NOW, 0)
    assert isinstance(out, Placement), out
    return out


@pytest.mark.parametrize("predictive", [True, False])
def test_the_routes_hold_a_second_prefill_engine(predictive: bool) -> None:
    out = _placed(_leg("p1", "prefill"), _leg("p2", "prefill", inflight=3), _leg("d1", "decode"),
                  _leg("d2", "decode"), _leg("d3", "decode"), predictive=predictive)
    prefills = [r.prefill.name for r in out.routes if r.prefill is not None]
    assert prefills[0] == "p1" and "p2" in prefills, [r.engines for r in out.routes]
    assert len(out.routes) <= 3 and out.first_engine == "p1"  # (the first route and its prediction as before)


def test_one_prefill_engine_or_another_dialect_adds_nothing() -> None:
    alone = _placed(_leg("p1", "prefill"), _leg("d1", "decode"), _leg("d2", "decode"))
    assert {r.prefill.name for r in alone.routes if r.prefill is not None} == {"p1"}
    other = _placed(_leg("p1", "prefill"), _leg("p2", "prefill", dialect="sglang"), _leg("d1", "decode"))
    assert [r.engines for r in other.routes] == [("p1", "d1")]


def test_a_unified_route_among_the_candidates_is_the_way_past_already() -> None:
    out = _placed(_leg("u1", "unified", inflight=1), _leg("p1", "prefill"), _leg("p2", "prefill", inflight=2),
                  _leg("d1", "decode"), _leg("d2", "decode"))
    before = [r.engines for r in out.routes]
    assert any(r.prefill is None for r in out.routes), before
    assert {r.prefill.name for r in out.routes if r.prefill is not None} <= {"p1"}, before


def test_the_spare_is_the_least_loaded_other_prefill_engine() -> None:
    out = _placed(_leg("p1", "prefill"), _leg("p2", "prefill", inflight=6), _leg("p3", "prefill", inflight=2),
                  _leg("d1", "decode"))
    assert [r.engines for r in out.routes] == [("p1", "d1"), ("p3", "d1")]


def _sse(route: str) -> httpx.Response:
    chunk = {"id": "chatcmpl-rid-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"},
                          "finish_reason": "stop", "token_ids": [42]}]}
    data = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
    return sse_response(data)


@pytest.mark.parametrize("status", [500, 503])
async def test_a_failed_prefill_engine_is_passed_by(status: int) -> None:
    out = _placed(_leg("p1", "prefill"), _leg("p2", "prefill", inflight=1), _leg("d1", "decode"),
                  _leg("d2", "decode"))
    seen: list[str] = []

    def handler(r: httpx.Request) -> httpx.Response:
        seen.append(r.url.host)
        if r.url.host == "p1":
            return httpx.Response(status, json={"error": {"message": "prefill trouble", "type": "x", "param": None,
                                                          "code": status}})
        if r.url.host == "p2":
            return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                                             "choices": [{"index": 0, "finish_reason": "length",
                                                          "message": {"role": "assistant", "content": "h"}}],
                                             "kv_transfer_params": {"remote_engine_id": "p2", "remote_block_ids": [1]}})
        return _sse("chat")

    body = json.dumps({"model": "m", "max_tokens": 8, "stream": True,
                       "messages": [{"role": "user", "content": "q"}]}).encode()
    req = parse_request("chat", body, model="m")
    placed = PlacedRequest("rid-1", "m", req, out.routes, time.time() + 30, first_token_s=5.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        msgs = [m async for m in Relay(client).run(placed)]
    assert msgs[-1].error is None, msgs[-1].error
    assert seen[0] == "p1" and "p2" in seen, seen
