"""Pure parts of ``narwhal-bench ramp`` and of the Serve status sampler: the schedule, the config,
the timeline, the checks, the command line."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import pytest

from narwhal_serve.bench import ramp, ramp_report
from narwhal_serve.bench.cli import build_parser
from narwhal_serve.bench.cli_runs import ramp_args
from narwhal_serve.bench.stats import RequestResult
from narwhal_serve.config import DeploymentKnobs, NarwhalConfig
from scripts.serve_replicas import running, snapshot


def test_schedule_rises_holds_and_falls_to_zero() -> None:
    a = ramp.RampArgs(peak=12, ramp_up_s=60, hold_s=20, ramp_down_s=30, step_s=5)
    sched = ramp.schedule(a)
    assert sched[0] == (0.0, 1)
    levels = [n for _, n in sched]
    top = levels.index(12)
    assert levels[: top + 1] == sorted(levels[: top + 1])  # only up to the peak
    assert levels[top:] == sorted(levels[top:], reverse=True)  # only down after it
    assert sched[-1] == (110.0, 0)  # the load ends at ramp_up + hold + ramp_down
    assert ramp_report.level_at(sched, -1) == 0 and ramp_report.level_at(sched, 70) == 12 and ramp_report.level_at(sched, 200) == 0
    assert all(t2 > t1 for (t1, _), (t2, _) in zip(sched, sched[1:]))


def test_serve_config_is_valid_narwhal_args_with_the_knobs() -> None:
    a = ramp.RampArgs(engines=3, tpot_s=0.04)
    cfg = ramp.ramp_serve_config(8123, 21000, a)
    assert cfg["http_options"] == {"host": "127.0.0.1", "port": 8123}
    [app] = cfg["applications"]
    assert (app["name"], app["route_prefix"], app["import_path"]) == ("narwhal", "/", "deployments.app:build_app")
    args = NarwhalConfig.model_validate(app["args"])
    assert args.engines == ()  # the embedded simulated fleet
    assert [e.tpot_base_s for e in args.sim.engines] == [0.04] * 3
    assert [e.url for e in args.resolved_engines()] == [f"http://127.0.0.1:{21000 + i}" for i in range(3)]
    ing = args.deployment.autoscaling("ingress")
    assert (ing["min_replicas"], ing["max_replicas"], ing["target_ongoing_requests"]) == (1, 3, 2.0)
    assert ing["downscale_delay_s"] < 600 and ing["upscale_delay_s"] < 30  # short enough to see in a run


def test_cli_builds_ramp_args_with_validated_knobs() -> None:
    ns = build_parser().parse_args(["ramp", "--peak", "6", "--ingress-replicas", "1,4", "--assembler-replicas",
                                    "2,3", "--target-ongoing", "3", "--downscale-delay-s", "9",
                                    "--ray-env", "RAY_SERVE_ENABLE_HA_PROXY=0"])
    a = ramp_args(ns)
    assert a.peak == 6 and a.ray_env == (("RAY_SERVE_ENABLE_HA_PROXY", "0"),)
    k = DeploymentKnobs.model_validate(a.knobs)
    assert (k.ingress_min_replicas, k.ingress_max_replicas, k.assembler_min_replicas, k.assembler_max_replicas) == \
        (1, 4, 2, 3)
    assert k.ingress_target_ongoing_requests == k.assembler_target_ongoing_requests == 3.0
    assert k.downscale_delay_s == 9.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ramp", "--ingress-replicas", "3"])


def _sample(t: float, ingress: dict[str, int], assembler: dict[str, int]) -> dict[str, object]:
    deps = {"Ingress": {"status": "HEALTHY", "replicas": ingress},
            "Assembler": {"status": "HEALTHY", "replicas": assembler}}
    return {"t": t, "apps": {"narwhal": {"status": "RUNNING", "deployments": deps}}}


def _result(idx: int, sent: float, e2e: float | None, status: int = 200, ok: bool = True) -> RequestResult:
    return RequestResult(idx=idx, target="narwhal", sent=sent, prompt_tokens=8, max_tokens=8, status=status, ok=ok,
                         e2e=e2e)


def test_timeline_and_summary_of_a_scale_up_and_down() -> None:
    t0 = 1000.0
    samples = [
        _sample(t0 - 1, {"RUNNING": 1}, {"RUNNING": 1}),
        _sample(t0 + 2, {"RUNNING": 1, "STARTING": 1}, {"RUNNING": 1}),
        {"t": t0 + 3, "error": "RayActorError: busy"},  # a failed sample is skipped
        _sample(t0 + 4, {"RUNNING": 2}, {"RUNNING": 2}),
        _sample(t0 + 8, {"RUNNING": 1, "STOPPING": 1}, {"RUNNING": 2}),
        _sample(t0 + 9, {"RUNNING": 1}, {"RUNNING": 1}),
    ]
    sched = [(0.0, 2), (6.0, 0)]
    results = [_result(0, 0.0, 1.0), _result(1, 0.5, 3.0), _result(2, 1.5, 0.1, status=429, ok=False),
               _result(3, 2.5, 0.5, status=200, ok=False)]
    rows = ramp_report.timeline(samples, results, sched, t0)
    assert [r["t"] for r in rows] == [-1.0, 2.0, 4.0, 8.0, 9.0]
    assert [r["clients"] for r in rows] == [0, 2, 2, 0, 0]
    assert rows[1]["in_flight"] == 1 and rows[1]["ok"] == 1 and rows[1]["refused"] == 1
    assert rows[-1]["failed"] == 1 and rows[-1]["ok"] == 2
    assert ramp_report.replica_cell(rows[1]["Ingress"]) == "1+1" and ramp_report.replica_cell(rows[3]["Ingress"]) == "1-1"
    assert ramp_report.settled(samples[-1], {"Ingress": 1, "Assembler": 1})
    assert not ramp_report.settled(samples[4], {"Ingress": 1, "Assembler": 1})

    knobs = DeploymentKnobs(ingress_max_replicas=3, assembler_max_replicas=3)
    s = ramp_report.summarize_ramp(rows, results, knobs, settle_s=3.0)
    assert s["requests"] == {"total": 4, "ok": 2, "failed": 1, "refused": 1,
                             "error_codes": {"http_429": 1, "http_200": 1}}
    assert s["deployments"]["Ingress"] == {"min": 1, "max": 3, "initial": 1, "peak": 2, "final": 1,
                                                "first_scale_up_t": 4.0, "back_at_min_t": 8.0}
    assert s["deployments"]["Assembler"]["back_at_min_t"] == 9.0
    verdicts = {c["check"]: c["verdict"] for c in s["checks"]}
    assert verdicts == {"Ingress peak replicas > min (1)": "PASS", "Ingress final replicas == min (1)": "PASS",
                        "Assembler peak replicas > min (1)": "PASS", "Assembler final replicas == min (1)": "PASS",
                        "failed requests": "MISS"}
    text = ramp_report.timeline_table(rows, 5.0)
    assert "1+1" in text and "Assembler" in text


class _State(str, Enum):
    RUNNING = "RUNNING"
    STARTING = "STARTING"


@dataclass
class _Dep:
    status: str
    replica_states: dict[_State, int]


@dataclass
class _App:
    status: str
    deployments: dict[str, _Dep]


@dataclass
class _Status:
    applications: dict[str, _App]


def test_sampler_snapshot_is_plain_json_of_serve_status() -> None:
    st = _Status({"narwhal": _App("RUNNING", {"Ingress": _Dep("UPSCALING", {_State.RUNNING: 1, _State.STARTING: 1}),
                                              "Assembler": _Dep("HEALTHY", {_State.RUNNING: 2, _State.STARTING: 0})}),
                  "other": _App("RUNNING", {})})
    snap = snapshot(st, "narwhal")
    assert snap == {"narwhal": {"status": "RUNNING", "deployments": {
        "Ingress": {"status": "UPSCALING", "replicas": {"RUNNING": 1, "STARTING": 1}},
        "Assembler": {"status": "HEALTHY", "replicas": {"RUNNING": 2}}}}}
    assert running(snap, "narwhal", "Assembler") == 2 and running(snap, "narwhal", "Scheduler") == 0
    assert set(snapshot(st)) == {"narwhal", "other"}
