"""Review of the router's metrics and the replay harness: each test shows one bug, fails now and
passes once it is fixed.  No Ray, no servers, no sockets; the replays are a handful of requests."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.managed.slot import ReplicaReport
from narwhal_serve.relay.messages import EngineFault
from narwhal_serve.replay.run import REPLAY_ENGINE, FleetSpec, Replay, ReplayOptions
from narwhal_serve.replay.trace import TraceRequest
from narwhal_serve.replay.vloop import run_virtual
from narwhal_serve.scheduler.messages import Report
from narwhal_serve.scheduler.service import SchedulerService
from tests.support.scheduler import Clock

ENGINE = REPLAY_ENGINE.model_copy(update={"prefill_per_token_s": 0.0002, "tpot_base_s": 0.01,
                                          "tpot_per_running_s": 0.001, "max_num_seqs": 16})


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ------------------------------------------------------------------ /metrics: counters never go down

def _replica(replica: str, port: int) -> ReplicaReport:
    return ReplicaReport(engine="m", replica=replica, url=f"http://10.0.0.1:{port}", node_id="node-a",
                         node_ip="10.0.0.1", accelerator_ids=("0",), pid=1000 + port, log=f"/tmp/{replica}.log",
                         ready_s=1.0)


async def test_engine_fault_counter_does_not_go_down_when_a_managed_engine_is_replaced() -> None:
    """``narwhal_engine_attempt_faults_total{engine,kind}`` (and ``narwhal_engine_probes_total``) are
    typed ``counter`` (docs/operations.md, "Metrics"; placement/health.py keeps them "by kind,
    ever").  A Prometheus counter only goes up while its process lives.  When Ray replaces a managed
    engine's replica, the slot keeps its name (the ``engine`` label) but scheduler/managed.py
    ``_take`` swaps in a fresh ``Breaker()``, so the router's own counter drops back to 0 in the
    same process: ``increase()`` over the window loses the faults, and the series breaks the
    counter contract."""
    clock = Clock()
    cfg = NarwhalConfig.model_validate({"engines": [
        {"name": "m", "role": "unified", "launch": {"kind": "sim", "replicas": 1}},
        {"name": "u", "url": "http://127.0.0.1:9", "role": "unified"},
    ]})
    svc = SchedulerService(cfg, clock=clock)
    svc.router.started = True
    svc.register_managed(_replica("r1", 8001))
    svc.report(Report(health=[EngineFault("m", "error", "reset"), EngineFault("m", "timeout", "silent")]))
    key_err = ("narwhal_engine_attempt_faults_total", (("engine", "m"), ("kind", "error")))
    key_to = ("narwhal_engine_attempt_faults_total", (("engine", "m"), ("kind", "timeout")))
    before = _samples(svc.metrics_text())
    assert before[key_err] == 1 and before[key_to] == 1
    svc.managed_down("m", "r1", "engine m (pid 9001) was killed by SIGKILL")
    svc.register_managed(_replica("r2", 8002))  # Ray's replacement takes the slot over
    after = _samples(svc.metrics_text())
    assert after[key_err] >= before[key_err], "a counter went down within one router process"
    assert after[key_to] >= before[key_to], "a counter went down within one router process"
    for t in list(svc._background):
        t.cancel()
    await asyncio.gather(*svc._background, return_exceptions=True)


# ------------------------------------------------------------------ replay: TTFT as the relay reports it

def _queued_replay() -> tuple[Replay, list]:  # type: ignore[type-arg]
    """Four 2,000-token prompts at once, one prefill permit: three wait in the scheduler's queue."""
    cfg = NarwhalConfig.model_validate({"admission": {"phase_concurrency": {"prefill": 1}, "ttft_budget_s": 10}})
    trace = [TraceRequest(i * 0.001, 2000, 20) for i in range(4)]
    rp = Replay(cfg, FleetSpec(unified=1, engine=ENGINE), ReplayOptions(ttft_s=10.0, ingresses=1))
    served = run_virtual(rp.run(trace))
    return rp, served


def test_replay_teaches_the_scheduler_the_engines_ttft_not_the_queue_wait() -> None:
    """``RelayStats.ttft_s`` is "the answering attempt's request to the engine → its first token (the
    models learn it)" (protocol/stats.py); the admission wait is in ``received_ttft_s`` only.  With
    ``--hop-ms 0`` that is exactly the simulated engine's own TTFT.  replay/run.py builds
    ``RelayStats(..., res.ttft, ...)`` with ``res.ttft`` counted from the client's send, so every
    request that waited in the scheduler's queue teaches the TTFT model, drift and
    ``narwhal_engine_ttft_measured_seconds_total`` its queue wait as prefill time."""
    rp, served = _queued_replay()
    assert all(s.ok for s in served)
    engine = rp.engines["unified-0"]
    engine_ttft_sum = engine.counters.ttft.sum  # each job's submit → first token, at the engine
    (row,) = rp.snapshot["served"]["ttft_by_engine"]
    assert row["n"] == 4
    assert abs(row["measured_s_sum"] - engine_ttft_sum) < 1e-6, (row, engine_ttft_sum)


def test_replay_predicted_ttft_counts_from_the_send_like_its_ttft() -> None:
    """The replay's TTFT prediction error (bench/stats.py ``ttft_prediction_error``) compares a
    request's TTFT, counted from its send, with its predicted TTFT, which the router reports as
    ``X-Narwhal-Predicted-TTFT`` = the wait so far + the projection (gateway/completion.py: "its
    predicted TTFT counted as its TTFT is, from its receipt").  replay/run.py stores the bare
    projection (``got.predicted_s``), so a queued request's error counts its whole queue wait.
    Here: (sum of predicted TTFTs) - (sum of projections) must equal (sum of client TTFTs) - (sum of
    engine TTFTs), the admission waits, at --hop-ms 0."""
    rp, served = _queued_replay()
    projections = rp.snapshot["served"]["ttft_by_engine"][0]["predicted_s_sum"]
    waits = sum(s.ttft for s in served) - rp.engines["unified-0"].counters.ttft.sum
    assert waits > 1.0  # (the setup: three requests queued ~0.4 s, ~0.8 s, ~1.2 s)
    predicted = sum(s.predicted_ttft for s in served)
    assert abs((predicted - projections) - waits) < 1e-3, (predicted, projections, waits)


# ------------------------------------------------------------------ replay: the trace's priority class

def test_replay_admits_each_request_in_its_traces_class() -> None:
    """Narwhal's own JSONL has an optional ``class`` (replay/trace.py, docs/performance.md "Capacity
    planning by replay"), and the replay claims to admit as the gateway does.  The gateway gives a
    request its ``X-Priority`` class, else ``admission.default_class`` ("standard"); replay/run.py
    never reads ``TraceRequest.klass`` and builds ``Ask`` with the default ``rank=0``, so every
    replayed request is admitted (and counted in ``narwhal_class_*``) as the top class
    "interactive", whatever the trace says — lower classes' headroom (``ttft_share``) is never
    exercised by a replay."""
    trace = [TraceRequest(i * 0.5, 200, 5, klass="batch") for i in range(3)]
    trace += [TraceRequest(2.0 + i * 0.5, 200, 5) for i in range(2)]
    rp = Replay(NarwhalConfig(), FleetSpec(unified=1, engine=ENGINE), ReplayOptions())
    served = run_virtual(rp.run(trace))
    assert all(s.ok for s in served)
    admitted = {c["class"]: c["admitted"] for c in rp.snapshot["classes"]}
    assert admitted == {"interactive": 0, "standard": 2, "batch": 3}, admitted
