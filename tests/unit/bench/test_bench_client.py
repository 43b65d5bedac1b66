"""The load generator against an in-process simulated engine on 127.0.0.1 (no subprocess)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from multidict import CIMultiDict

from narwhal_serve.bench.client import (
    Endpoint,
    RetryPolicy,
    Shape,
    parse_error,
    _retry_after,
    make_session,
    run_closed_loop,
    run_open_loop,
)
from narwhal_serve.bench.workload import LengthDist, Workload
from narwhal_serve.sim.server import SimServer
from tests.support.sim import sim_engine

WL = Workload(LengthDist(16, 0.0, 16, 16), LengthDist(5, 0.0, 5, 5), seed=1)


@pytest.fixture
async def engine() -> AsyncIterator[SimServer]:
    async with sim_engine(prefill_overhead_s=0.005, prefill_per_token_s=0, tpot_base_s=0.002) as srv:
        yield srv


@pytest.mark.parametrize("stream", [True, False])
async def test_closed_loop_measures(engine: SimServer, stream: bool) -> None:
    ep = Endpoint("direct", (engine.url,))
    async with make_session() as s:
        rs = await run_closed_loop(s, ep, Shape(stream=stream), WL.closed_loop_specs(12), concurrency=3,
                                   duration_s=5.0)
    assert len(rs) == 12 and all(r.ok and r.status == 200 for r in rs)
    for r in rs:
        assert r.output_tokens == 5 and r.ttft is not None and r.e2e is not None and r.e2e >= r.ttft
        if stream:
            assert r.ttft >= 0.004 and len(r.itl) == 4 and r.tpot is not None
        else:
            assert r.ttft == r.e2e and r.itl == []


async def test_open_loop_sends_on_schedule_and_records_errors(engine: SimServer) -> None:
    ep = Endpoint("direct", (engine.url,))
    specs = WL.specs([0.0, 0.05, 0.1, 0.15])
    async with make_session() as s:
        rs = await run_open_loop(s, ep, Shape(model="no-such-model"), specs, drain_s=2.0, retry=RetryPolicy())
    assert [r.status for r in rs] == [404] * 4
    assert all(r.error_code == "404" for r in rs)  # the simulator's envelope carries the status as code
    assert [round(r.sent, 1) for r in rs] == [0.0, 0.1, 0.1, 0.2] or rs[-1].sent >= 0.15


async def test_cut_at_drain(engine: SimServer) -> None:
    ep = Endpoint("direct", (engine.url,))
    slow = Workload(LengthDist(16, 0.0, 16, 16), LengthDist(2000, 0.0, 2000, 2000)).specs([0.0])
    async with make_session() as s:
        rs = await run_open_loop(s, ep, Shape(), slow, drain_s=0.3)
    assert rs[0].error_code == "cut" and not rs[0].ok


def test_error_and_retry_after_parsing() -> None:
    h = CIMultiDict({"Retry-After": "3", "X-Narwhal-Reason": "queue_full"})
    assert parse_error(b'{"error": {"code": "ttft_budget_exceeded"}}', h) == "ttft_budget_exceeded"
    assert parse_error(b"not json", h) == "queue_full"
    assert _retry_after(h) == 3.0
    assert _retry_after(CIMultiDict({"Retry-After": "soon"})) is None


def test_retry_policy_is_bounded() -> None:
    p = RetryPolicy(max_samples=3, probability=1.0)
    assert [p.take() for _ in range(5)] == [True, True, True, False, False]
    # which clients retry is drawn per request, the same for every target (and seed)
    assert not any(RetryPolicy(probability=0.0).wants(i) for i in range(50))
    assert all(RetryPolicy(probability=1.0).wants(i) for i in range(50))
    half = [RetryPolicy(probability=0.5, seed=3).wants(i) for i in range(200)]
    assert half == [RetryPolicy(probability=0.5, seed=3).wants(i) for i in range(200)] and 60 < sum(half) < 140


def test_endpoint_round_robin() -> None:
    ep = Endpoint("d", ("http://a", "http://b/"))
    assert ep.url_for(0, "chat") == "http://a/v1/chat/completions"
    assert ep.url_for(3, "completions") == "http://b/v1/completions"
