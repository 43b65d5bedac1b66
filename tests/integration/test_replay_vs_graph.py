"""The replay against reality: one 3-minute slice of the Azure trace (its arrivals 2.5× closer, so
the run takes 72 s; at 3× the two cores shared by Ray, the router, both engines and the client fell
behind the engines' timing), sent in real time through the Ray graph to two simulated engines, and
replayed in virtual time with the same settings, must agree on goodput, refusal rate and p99 TTFT
(docs/performance.md, "Capacity planning by replay", says where and why the two differ)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from narwhal_serve.bench.client import Endpoint, RetryPolicy, Shape, make_session, run_open_loop
from narwhal_serve.bench.replay import TRACE_DIR, TRACES, _result, slice_trace
from narwhal_serve.bench.stats import Slo, summarize
from narwhal_serve.bench.workload import RequestSpec, make_prompt
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.replay.run import REPLAY_ENGINE, FleetSpec, Replay, ReplayOptions
from narwhal_serve.replay.trace import TraceRequest, load
from narwhal_serve.replay.vloop import run_virtual
from tests.integration.conftest import MODEL, Graph
from tests.integration.helpers import balanced, status, wait_ready, wait_status
from tests.support.net import free_port_run

APP = "replaycheck"
START_S, SLICE_S, SPEED, OUTPUT_DIV = 600.0, 180.0, 2.5, 16  # (outputs ÷ 16: fewer tokens for two cores to stream)
TTFT_S = 1.0
TIMING = {"prefill_overhead_s": 0.005, "prefill_per_token_s": 0.00009, "tpot_base_s": 0.02,
          "tpot_per_running_s": 0.001, "max_num_seqs": 16, "max_model_len": 65536, "num_gpu_blocks": 16384}
ENGINES = ["rc-a", "rc-b"]
ROUTER: dict[str, Any] = {
    "model": MODEL,
    "admission": {"mode": "predictive", "ttft_budget_s": TTFT_S},
    "monitoring": {"scrape_interval_s": 0.5, "stale_after_s": 5.0},
}
# run in the default mode (direct ingress) only: the replay models no ingress path, so the second
# run mode would check nothing new for another minute and a half of CI
pytestmark = pytest.mark.skipif(os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "1",
                                reason="replay vs graph: the direct-ingress run mode only")
AGREE = 0.10  # relative, for goodput and p99 TTFT; absolute (share of requests) for the refusal rate


def _slice() -> list[TraceRequest]:
    trace = slice_trace(load(TRACE_DIR / TRACES["azure"]), START_S, SLICE_S, None)
    return [replace(r, output_tokens=max(1, r.output_tokens // OUTPUT_DIV)) for r in trace]


@pytest.fixture(scope="module")
def app(graph: Graph) -> Iterator[tuple[str, list[str]]]:
    from ray import serve

    from deployments.app import build_app

    base = free_port_run(len(ENGINES), start=graph.sim_base + 40)
    serve.run(build_app({
        **ROUTER,
        "sim": {"base_port": base, "engines": [{"name": n, "role": "unified", **TIMING} for n in ENGINES]},
        "deployment": {"ingress_max_replicas": 1, "assembler_max_replicas": 1},
    }), name=APP, route_prefix=f"/{APP}")
    url = f"{graph.url}/{APP}"
    try:
        asyncio.run(wait_ready(url, 200, timeout=60))
        yield url, [f"http://127.0.0.1:{base + i}" for i in range(len(ENGINES))]
    finally:
        serve.delete(APP)


def _replayed(trace: list[TraceRequest], hop_s: float = 0.0, speed: float = SPEED) -> dict[str, Any]:
    engine = REPLAY_ENGINE.model_copy(update=TIMING)
    rp = Replay(NarwhalConfig.model_validate(ROUTER), FleetSpec(unified=len(ENGINES), engine=engine),
                ReplayOptions(ttft_s=TTFT_S, speed=speed, ingresses=1, hop_s=hop_s))
    results = [_result(s) for s in run_virtual(rp.run(trace))]
    return summarize(results, Slo(TTFT_S, float("inf")), duration_s=(trace[-1].at_s - trace[0].at_s) / speed or None)


# The router's own path (HAProxy, the ingress replica, the HTTP call to the engine and the stream's
# way back), which the replay does not run: measured on this machine as what short requests at 8
# at a time take through the graph beyond what they take in the replay, and given to the replay as
# its hop (half each way).
PROBES = [TraceRequest(at_s=i * 0.02, input_tokens=64, output_tokens=2) for i in range(48)]


# The replay's answer moves with its inputs: a burst near the TTFT target is admitted or refused on
# a few milliseconds, and the requests queued behind it follow, so on this slice its p99 TTFT jumps
# between about 760 and 860 ms as the hop moves by tenths of a millisecond (the real run's moves
# between runs the same way: 827-869 ms in five runs alike). The path is measured to about a
# millisecond, so the replay runs over a band of hops around it (2 s each) and its median is
# what the real run is compared with.
HOP_BAND = (0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25, 1.375, 1.5)


def _replayed_band(trace: list[TraceRequest], path_s: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The replay at the measured path (half each way), and at each hop of :data:`HOP_BAND`."""
    runs = [_replayed(trace, path_s * f / 2) for f in HOP_BAND]
    return runs[HOP_BAND.index(1.0)], runs


async def _path_s(url: str) -> float:
    real = await _real(url, PROBES, speed=1.0)
    virtual = await asyncio.to_thread(_replayed, PROBES, 0.0, 1.0)
    return max(0.0, (real["ttft_ms"]["p50"] - virtual["ttft_ms"]["p50"]) / 1000.0)


async def _real(url: str, trace: list[TraceRequest], speed: float = SPEED) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    t0 = trace[0].at_s
    specs = [RequestSpec(i, (r.at_s - t0) / speed, r.input_tokens, r.output_tokens, make_prompt(rng, r.input_tokens))
             for i, r in enumerate(trace)]
    async with make_session() as session:
        results = await run_open_loop(session, Endpoint("narwhal", (url,)), Shape(api="completions", model=MODEL),
                                      specs, drain_s=30.0, retry=RetryPolicy(max_samples=10 ** 6, probability=1.0))
    return summarize(results, Slo(TTFT_S, float("inf")), duration_s=(trace[-1].at_s - t0) / speed or None)


# The simulated engines keep their timing with timers: on a host short of CPU (two cores for Ray,
# the router, both engines and the client) their prefills wake late, each delaying the ones queued
# behind it, and the engines serve less than the timing the replay is given. Beyond this share of
# their prefill time the real run measured the host, not the router: the comparison is not made.
LATE_LIMIT = 0.02  # (alone on this VM: 0.8 %; with one core kept busy: 4.3 %, and the two disagreed by 16 % on p99 TTFT)


async def _lateness(engines: list[str]) -> dict[str, float]:
    """The engines' prefill timing so far, summed (sim/engine.py, TimerLateness)."""
    out = {"prefills": 0.0, "prefill_s": 0.0, "prefill_late_s": 0.0}
    async with httpx.AsyncClient(timeout=10) as c:
        for url in engines:
            timer = (await c.get(url + "/sim/stats")).json()["timer"]
            for k in out:
                out[k] += timer[k]
    return out


async def test_replay_agrees_with_the_graph_on_goodput_refusals_and_p99_ttft(app: tuple[str, list[str]]) -> None:
    app, engines = app
    trace = _slice()
    assert len(trace) > 500
    await wait_status(app, lambda s: all(e["eligible"] for e in s["engines"]), "both engines eligible")
    before = await _lateness(engines)
    real = await _real(app, trace)
    after = await _lateness(engines)
    await wait_status(app, balanced, "every request ended and released", timeout=60)
    timed = {k: after[k] - before[k] for k in after}
    assert timed["prefills"] >= real["completed"] * 0.9  # (the timer saw the run's prefills)
    late = timed["prefill_late_s"] / max(timed["prefill_s"], 1e-9)
    print(f"\nthe engines' prefills ran {late:.1%} late ({timed['prefill_late_s']:.2f} s over "
          f"{timed['prefill_s']:.2f} s modelled, {timed['prefills']:.0f} prefills)")
    if late > LATE_LIMIT:
        pytest.skip(f"this host could not keep the simulated engines' timing: their prefills ran {late:.1%} "
                    f"late (limit {LATE_LIMIT:.0%}), so the real run measured the host, not the router")
    path_s = await _path_s(app)
    await wait_status(app, balanced, "every probe ended and released", timeout=60)
    assert path_s < 0.1  # (the router's own path is milliseconds)
    virtual, band = await asyncio.to_thread(_replayed_band, trace, path_s)  # (its own loop, on a virtual clock)

    def value(summary: dict[str, Any], k: str) -> float:
        return float(summary["ttft_ms"]["p99"] if k == "ttft_p99_ms" else summary[k])

    rows: dict[str, dict[str, Any]] = {
        k: {"real": value(real, k), "virtual": float(np.median([value(v, k) for v in band])),
            "virtual_band": [value(v, k) for v in band]}
        for k in ("goodput_rps", "refusal_rate", "ttft_p99_ms")}
    rows["ttft_prediction_err_p50"] = {"real": real["ttft_prediction"]["err_p50"],
                                       "virtual": virtual["ttft_prediction"]["err_p50"]}
    print(f"\nreplay vs graph (the router's path: {path_s * 1000:.1f} ms; virtual: the median over hops of "
          f"{HOP_BAND[0]}-{HOP_BAND[-1]}x that path):", json.dumps(rows))
    out = os.environ.get("NARWHAL_REPLAY_CHECK_OUT")
    if out:
        Path(out).write_text(json.dumps({"rows": rows, "real": real, "virtual": virtual}, indent=1))
    assert real["offered"] == len(trace) and all(v["offered"] == len(trace) for v in band)
    g, r, t = rows["goodput_rps"], rows["refusal_rate"], rows["ttft_p99_ms"]
    assert abs(g["real"] - g["virtual"]) <= AGREE * g["virtual"], rows
    assert abs(r["real"] - r["virtual"]) <= AGREE, rows
    assert abs(t["real"] - t["virtual"]) <= AGREE * t["virtual"], rows
    snap = await status(app)
    assert snap["counters"]["completed"] >= real["completed"]
