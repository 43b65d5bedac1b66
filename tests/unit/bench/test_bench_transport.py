"""narwhal_serve.bench.transport: rotation, summary math, the closed loop, and a short run of the
httpx variants against an in-process simulated engine on 127.0.0.1."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

from narwhal_serve.bench import transport as tr
from narwhal_serve.bench import transport_checks as trc
from narwhal_serve.bench import transport_clients as tcl
from narwhal_serve.bench.transport import Phase, PhaseResult, rotated, schedule, summarize
from narwhal_serve.bench.transport_checks import Check
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.sim.server import SimServer
from tests.support.sim import sim_engine


def test_rotated() -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert rotated([], 3) == []


def test_schedule_is_balanced_and_interleaved() -> None:
    vs, cs = ["httpx", "httpx-aiohttp", "aiohttp"], [1, 8, 32]
    plan = schedule(vs, cs, rounds=3)
    assert len(plan) == 27 and len(set(plan)) == 27
    # each round runs every concurrency once, variants adjacent (interleaved, never batched per variant)
    for r in range(3):
        rnd = [p for p in plan if p.round == r]
        assert [p.concurrency for p in rnd] == [1, 1, 1, 8, 8, 8, 32, 32, 32]
    # at every concurrency each variant takes each position exactly once over 3 rounds
    for c in cs:
        pos = Counter()
        for r in range(3):
            order = [p.variant for p in plan if p.round == r and p.concurrency == c]
            assert sorted(order) == sorted(vs)
            pos.update(enumerate(order))
        assert set(pos.values()) == {1} and len(pos) == 9
    # the variant opening each concurrency changes within a round
    assert [p.variant for p in plan[:9:3]] == ["httpx", "httpx-aiohttp", "aiohttp"]


def test_schedule_edges() -> None:
    assert schedule(["a"], [1, 2], 2) == [Phase(0, 1, "a"), Phase(0, 2, "a"), Phase(1, 1, "a"), Phase(1, 2, "a")]
    assert schedule(["a", "b"], [4], 0) == []


def _pr(r: int, c: int, v: str, sent: int, errors: int, wall: float, cpu: float, eng: float | None,
        ttfc: list[float]) -> PhaseResult:
    return PhaseResult(Phase(r, c, v), sent, errors, wall, cpu, eng, ttfc)


def test_summarize_math_and_order() -> None:
    rs = [
        _pr(0, 8, "aiohttp", 10, 0, 1.0, 0.005, 0.010, [0.001] * 10),
        _pr(0, 8, "httpx", 10, 0, 2.0, 0.020, 0.020, [0.002] * 10),
        _pr(1, 8, "httpx", 10, 2, 1.0, 0.010, 0.010, [0.004] * 8),
        _pr(1, 8, "aiohttp", 10, 0, 1.0, 0.005, None, [0.003] * 10),
        _pr(0, 1, "httpx", 4, 0, 1.0, 0.004, 0.004, [0.001, 0.002, 0.003, 0.004]),
    ]
    rows = summarize(rs)
    assert [(r["concurrency"], r["variant"]) for r in rows] == [(1, "httpx"), (8, "httpx"), (8, "aiohttp")]
    one, hx, ai = rows
    assert one["ttfc_p50_ms"] == pytest.approx(2.5) and one["ttfc_p99_ms"] == pytest.approx(3.97)
    assert one["rps"] == 4.0 and one["client_cpu_ms"] == pytest.approx(1.0) and one["cpu_vs_httpx"] == 1.0
    # httpx at 8: 18 ok over 3 s; 30 ms CPU over 20 sent; engine 30 ms over 20
    assert hx["sent"] == 20 and hx["errors"] == 2 and hx["rps"] == 6.0
    assert hx["client_cpu_ms"] == pytest.approx(1.5) and hx["engine_cpu_ms"] == pytest.approx(1.5)
    assert hx["rps_rounds"] == [5.0, 8.0] and hx["client_cpu_ms_rounds"] == [2.0, 1.0]
    assert hx["ttfc_p50_ms"] == pytest.approx(2.0)  # pooled: 10 x 2 ms, 8 x 4 ms
    # aiohttp at 8: 0.5 ms/req, a third of httpx's; one round without engine CPU -> no engine figure
    assert ai["client_cpu_ms"] == pytest.approx(0.5) and ai["cpu_vs_httpx"] == pytest.approx(0.33)
    assert ai["engine_cpu_ms"] is None and ai["rps"] == 10.0
    text = tr.summary_table(rows)
    assert "CPU vs httpx" in text and text.count("\n") == 4 and "1.00-2.00" in text


def test_summarize_without_baseline_or_requests() -> None:
    rows = summarize([_pr(0, 1, "aiohttp", 0, 0, 0.0, 0.0, None, [])])
    assert rows[0]["rps"] is None and rows[0]["client_cpu_ms"] is None and rows[0]["ttfc_p50_ms"] is None
    assert rows[0]["cpu_vs_httpx"] is None
    assert summarize([]) == []


async def test_closed_loop_counts_errors_and_short_streams() -> None:
    seen: list[int] = []

    async def one(i: int) -> tuple[float, int]:
        seen.append(i)
        if i % 5 == 0:
            raise RuntimeError("boom")
        return 0.001 * i, 3 if i % 7 else 2

    ttfc, errors, sample = await tcl.closed_loop(one, 20, 4, 3, itertools.count(1))
    assert sorted(seen) == list(range(1, 21))
    assert errors == 4 + 2  # 5, 10, 15, 20 raise; 7, 14 are short
    assert len(ttfc) == 14 and sample is not None


def test_exc_chain_and_checks_table() -> None:
    try:
        try:
            raise ConnectionRefusedError("no")
        except OSError as exc:
            raise httpx.ConnectError("x") from exc
    except httpx.HTTPError as exc:
        chain = trc.exc_chain(exc)
    assert chain == ["httpx.ConnectError", "builtins.ConnectionRefusedError"]
    text = trc.checks_table([Check("refused", "httpx", True, "EngineFailure: x", chain), Check("b", "v", False, "d")])
    assert "ConnectError <- builtins.ConnectionRefusedError" in text and " NO " in text


@pytest.fixture
async def engine() -> AsyncIterator[SimServer]:
    async with sim_engine(prefill_overhead_s=0, prefill_per_token_s=0, tpot_base_s=0) as srv:
        yield srv


async def test_short_bench_httpx_and_raw_aiohttp(engine: SimServer) -> None:
    a = tr.TransportArgs(variants=["httpx", "aiohttp"], concurrencies=[1, 4], rounds=2, requests=6, warmup=2,
                         tokens=4, checks=False)
    phases = await tr.bench(a, engine.url, None)
    assert len(phases) == 8 and all(p.errors == 0 and len(p.ttfc_s) == 6 for p in phases)
    assert all(p.cpu_s > 0 and p.engine_cpu_s is None for p in phases)
    assert [(r["concurrency"], r["variant"]) for r in summarize(phases)] == [
        (1, "httpx"), (1, "aiohttp"), (4, "httpx"), (4, "aiohttp")]


async def test_httpx_aiohttp_variant_maps_failures(engine: SimServer) -> None:
    pytest.importorskip("httpx_aiohttp")
    url = engine.url + "/v1/chat/completions"
    async with tcl.httpx_aiohttp_client() as client:
        chunks = await trc._drain(client, url, tcl.chat_body("narwhal-sim", 5))
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 5
        body = {**tcl.chat_body("narwhal-sim", 8), "sim": {"fault": "reset_mid_stream"}}
        with pytest.raises(EngineFailure, match="stream broken: ReadError"):
            await trc._drain(client, url, body)
        with pytest.raises(EngineFailure, match="HTTP 500"):
            await trc._drain(client, url, {**tcl.chat_body("narwhal-sim", 4), "sim": {"fault": "error_500"}})
