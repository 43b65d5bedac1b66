"""Pure parts of ``narwhal-bench soak``: the mix, the engine-fault schedule, process roles and RSS
parsing, growth and verdicts, the router's books, the report and the command line (no Ray)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from narwhal_serve.bench import procs, rss, soak, soak_mix, soak_report
from narwhal_serve.bench.cli import build_parser
from narwhal_serve.bench.cli_runs import soak_args
from narwhal_serve.bench.stats import RequestResult
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.config.sim import FAULT_NAMES

STATUS_TEXT = "Name:\tpython\nVmPeak:\t  200000 kB\nVmRSS:\t  148652 kB\nRssAnon:\t  100 kB\n"


def test_parse_vm_rss() -> None:
    assert procs.parse_vm_rss(STATUS_TEXT) == 148652
    assert procs.parse_vm_rss("Name:\tkthreadd\nState:\tS (sleeping)\n") is None  # kernel threads have none
    assert procs.parse_vm_rss("VmRSS:\n") is None


@pytest.mark.parametrize(("label", "supervisor", "role", "judged"), [
    ("ray::ServeReplica:narwhal:Ingress", False, "replica Ingress", True),
    ("ray::ServeReplica:narwhal:SimFleet", False, "replica SimFleet", True),
    ("ray::ServeController", False, "Serve controller", True),
    ("ray::ProxyActor", False, "Serve proxy actor", True),
    ("ray::HAProxyManager", False, "Serve HAProxy manager", True),
    ("haproxy", False, "HAProxy", True),
    ("serve run", False, "serve run (driver)", True),
    ("serve", True, "supervisor (serve_run.py)", True),
    ("ray::ServeReplica:other:Ingress", False, "ray ServeReplica:other:Ingress", False),
    ("ray::DashboardAgent", False, "ray DashboardAgent", False),
    ("gcs_server", False, "ray gcs_server", False),
    ("dashboard", False, "ray dashboard", False),
])
def test_roles(label: str, supervisor: bool, role: str, judged: bool) -> None:
    assert rss.role_for(label, "narwhal", supervisor) == role
    assert rss.judged(role) is judged


def test_group_roles_sums_processes() -> None:
    g = rss.group_roles([(1, "HAProxy", 10), (2, "HAProxy", 5), (3, "replica Ingress", 100)])
    assert g == {"HAProxy": {"rss_kb": 15, "n": 2, "pids": [1, 2]},
                 "replica Ingress": {"rss_kb": 100, "n": 1, "pids": [3]}}


def _sample(t: float, **roles_kb: int) -> dict[str, Any]:
    roles = {k.replace("_", " "): {"rss_kb": kb, "n": 1, "pids": [i]} for i, (k, kb) in enumerate(roles_kb.items())}
    return {"t": t, "roles": roles}


def test_growth_from_the_baseline_sample_to_the_last() -> None:
    samples = [_sample(0, replica_Ingress=100_000, ray_gcs=50_000, HAProxy=10_000),
               _sample(10, replica_Ingress=150_000, ray_gcs=60_000, HAProxy=10_000),  # warm-up
               _sample(20, replica_Ingress=160_000, ray_gcs=60_000, HAProxy=10_000),  # the baseline (t >= 15)
               _sample(30, replica_Ingress=175_000, ray_gcs=90_000)]  # HAProxy gone
    rows = {r["role"]: r for r in rss.rss_summary(samples, baseline_s=15.0, max_growth_pct=10.0)}
    ing = rows["replica Ingress"]
    assert ing["baseline_t"] == 20 and ing["growth_pct"] == pytest.approx(9.38, abs=0.01)
    assert ing["verdict"] == "ok" and ing["first_mb"] == round(100_000 / 1024, 1)
    assert ing["max_mb"] == ing["last_mb"] == round(175_000 / 1024, 1)
    assert rows["ray gcs"]["verdict"] == "info" and rows["ray gcs"]["growth_pct"] == 50.0  # reported, not judged
    assert rows["HAProxy"]["verdict"] == "GONE"
    assert [r["role"] for r in rss.rss_summary(samples, 15.0, 10.0)][-1] == "ray gcs"  # judged roles first
    grew = rss.rss_summary(samples, baseline_s=15.0, max_growth_pct=9.0)
    assert next(r for r in grew if r["role"] == "replica Ingress")["verdict"] == "GREW"
    late = rss.rss_summary(samples, baseline_s=99.0, max_growth_pct=10.0)
    assert next(r for r in late if r["role"] == "replica Ingress")["verdict"] == "n/a"


def test_growth_sums_the_processes_of_a_role() -> None:
    s0 = {"t": 0, "roles": {"HAProxy": {"rss_kb": 100, "n": 1, "pids": [7]}}}
    s1 = {"t": 5, "roles": {"HAProxy": {"rss_kb": 100, "n": 2, "pids": [7, 8]}}}  # a reload: old + new
    s2 = {"t": 9, "roles": {"HAProxy": {"rss_kb": 105, "n": 1, "pids": [8]}}}
    [row] = rss.rss_summary([s0, s1, s2], 0.0, 10.0)
    assert (row["procs_min"], row["procs_max"], row["pids_seen"], row["growth_pct"]) == (1, 2, 2, 5.0)
    assert "1-2" in rss.rss_table([row])


SNAP: dict[str, Any] = {
    "counters": {"offered": 10, "unsized_offered": 1, "completed": 6, "failed": 1, "rejected": 0, "refused": 1,
                 "invalid_requests": 1, "expired": 0, "cancelled": 1},
    "counters_by_reason": [{"outcome": "completed", "reason": "", "count": 6},
                           {"outcome": "cancelled", "reason": "client_disconnected", "count": 1}],
    "gauges": {"retained": 0, "queued": 0, "prefill_inflight": 0, "decode_inflight": 0},
    "admission_leases": [{"lease": "a", "in_use": {"retention": 0, "prefill": 0, "decode": 0}}],
}


def test_books_balance_and_leaks() -> None:
    b = soak_report.books(SNAP)
    assert (b["offered"], b["terminal"], b["unbalanced"], b["leaked_permits"], b["balanced"]) == (10, 10, 0, 0, True)
    leaky = {**SNAP, "gauges": {**SNAP["gauges"], "retained": 1, "decode_inflight": 2},
             "counters": {**SNAP["counters"], "offered": 11}}
    b = soak_report.books(leaky)
    assert (b["unbalanced"], b["leaked_permits"], b["balanced"]) == (1, 3, False)
    queued = soak_report.books({**SNAP, "gauges": {**SNAP["gauges"], "queued": 1}})
    assert queued["leaked_permits"] == 0 and not queued["balanced"]  # a queued request is not a permit
    assert soak_report.router_outcomes(SNAP)[1] == ("cancelled", "client_disconnected", 1)


def test_checks_fail_on_leaks_imbalance_and_growth() -> None:
    rss = [{"role": "replica Ingress", "judged": True, "verdict": "ok", "growth_pct": 3.0},
           {"role": "ray gcs", "judged": False, "verdict": "info", "growth_pct": 50.0}]
    ok = soak_report.soak_checks(rss, soak_report.books(SNAP), completed=5, max_growth_pct=10.0)
    assert all(c["verdict"] == "PASS" for c in ok) and not any("ray gcs" in c["check"] for c in ok)
    grew = soak_report.soak_checks([{**rss[0], "growth_pct": 10.0}], soak_report.books(SNAP), 5, 10.0)  # >= 10 % fails
    assert [c["verdict"] for c in grew if "RSS" in c["check"]] == ["MISS"]
    leaky = soak_report.books({**SNAP, "gauges": {**SNAP["gauges"], "prefill_inflight": 1}})
    assert any(c["verdict"] == "MISS" and c["check"] == "leaked permits"
               for c in soak_report.soak_checks(rss, leaky, 5, 10.0))
    unread = soak_report.soak_checks(rss, None, 5, 10.0)
    assert any(c["verdict"] == "n/a" for c in unread)
    gone = soak_report.soak_checks([{**rss[0], "verdict": "GONE"}], soak_report.books(SNAP), 5, 10.0)
    assert [c["verdict"] for c in gone if "running at the end" in c["check"]] == ["MISS"]


def test_request_faults_cover_every_per_request_fault() -> None:
    assert set(soak_mix.REQUEST_FAULTS) == FAULT_NAMES - {"unhealthy", "stale_metrics"}
    assert soak_mix.HANG_FAULTS <= set(soak_mix.REQUEST_FAULTS)
    assert set(soak.ENGINE_FAULTS) <= FAULT_NAMES


def test_the_mix_is_seeded_and_shaped() -> None:
    a = soak_mix.SoakArgs(fault_rate=0.2, disconnect_rate=0.1, malformed_rate=0.1)
    rng = np.random.default_rng(3)
    plans = [soak_mix.plan_request(rng, a, i) for i in range(3000)]
    again = [soak_mix.plan_request(np.random.default_rng(3), a, 0)]
    assert again[0].tag == plans[0].tag and again[0].spec.prompt == plans[0].spec.prompt
    kinds = Counter(p.kind for p in plans)
    assert kinds["fault"] == pytest.approx(600, rel=0.2) and kinds["normal"] == pytest.approx(1800, rel=0.1)
    assert kinds["leave_mid_stream"] and kinds["leave_before_headers"] and kinds["malformed"] and kinds["truncated_body"]
    for p in plans:
        sim = (p.extra or {}).get("sim", {})
        if p.kind == "fault":
            assert sim["fault"] in soak_mix.REQUEST_FAULTS and 0 <= sim["fault_after"] < 5
            hang = sim["fault"] in soak_mix.HANG_FAULTS
            timeout = dict(p.shape.extra_headers).get("X-Request-Timeout")
            assert (timeout is not None) == hang and (not hang or 2.0 <= float(timeout) <= 5.0)
        if p.kind == "leave_mid_stream":
            assert p.shape.stream and 1 <= p.leave_after <= 5 and p.spec.output_tokens >= 64
        if p.kind == "leave_before_headers":
            assert not p.shape.stream and 0.01 <= p.leave_after <= 0.2
        if p.kind == "malformed":
            assert p.raw_body in soak_mix.MALFORMED_BODIES
        if p.kind == "truncated_body":
            assert p.raw_body is not None and json.loads(p.raw_body)["model"] == a.model
        assert 4 <= p.spec.prompt_tokens <= 2048 and 1 <= p.spec.output_tokens <= 256
    normal = [p for p in plans if p.kind == "normal"]
    assert {p.shape.api for p in normal} == {"chat", "completions"}
    assert {p.shape.stream for p in normal} == {True, False}
    assert {p.shape.include_usage for p in normal} == {True, False}
    assert any(p.tag.startswith("normal script=") for p in normal)
    with pytest.raises(ValueError):
        soak_mix.SoakArgs(fault_rate=0.6, disconnect_rate=0.3, malformed_rate=0.2)


def test_outcome_and_status_keys() -> None:
    r = RequestResult(idx=0, target="n", sent=0.0, prompt_tokens=1, max_tokens=1, status=200, ok=True)
    assert (soak_mix.outcome(r), soak_mix.status_key(r)) == ("ok", "200")
    left = RequestResult(idx=0, target="n", sent=0.0, prompt_tokens=1, max_tokens=1, error_code="left before headers")
    assert (soak_mix.outcome(left), soak_mix.status_key(left)) == ("left before headers", "left")
    gone = RequestResult(idx=0, target="n", sent=0.0, prompt_tokens=1, max_tokens=1, error_code="ClientOSError")
    assert soak_mix.status_key(gone) == "none"
    refused = RequestResult(idx=0, target="n", sent=0.0, prompt_tokens=1, max_tokens=1, status=429)
    assert soak_mix.outcome(refused) == "HTTP 429"


def test_engine_fault_schedule_rotates_and_ends_before_the_tail() -> None:
    eps = soak.engine_fault_schedule(600, 45, 10, ["p", "d", "u"])
    assert eps[0] == soak.Episode(45.0, 55.0, "p", "unhealthy")
    assert all(e.end_s <= 600 - 30 for e in eps) and len(eps) == 12
    assert len({(e.engine, e.fault) for e in eps[:9]}) == 9  # every engine meets every fault
    assert all(b.start_s >= a.end_s for a, b in zip(eps, eps[1:]))  # one at a time
    assert soak.engine_fault_schedule(600, 0, 10, ["p"]) == []
    assert soak.engine_fault_schedule(60, 45, 10, ["p"]) == []  # would end inside the tail


def test_serve_config_is_the_run_configs_application(tmp_path: Path) -> None:
    cfg = soak.soak_serve_config(8123, 21000, "narwhal-sim")
    assert cfg["http_options"] == {"host": "127.0.0.1", "port": 8123}
    [app] = cfg["applications"]
    args = NarwhalConfig.model_validate(app["args"])
    assert args.admission.mode == "predictive"
    assert [e.role for e in args.resolved_engines()] == ["prefill", "decode", "unified"]
    assert soak.sim_engines(cfg) == {"sim-prefill-0": "http://127.0.0.1:21000",
                                     "sim-decode-0": "http://127.0.0.1:21001",
                                     "sim-unified-0": "http://127.0.0.1:21002"}
    results, folder = soak.output_paths(tmp_path / "r.json")
    assert results == tmp_path / "r.json" and folder == tmp_path / "r-files" and folder.is_dir()
    results, folder = soak.output_paths(tmp_path / "out")
    assert results.parent == folder and folder.parent == tmp_path / "out" and folder.name.startswith("soak-")


def test_report_text_and_json(tmp_path: Path) -> None:
    a = soak_mix.SoakArgs(minutes=1.0, engine_fault_s=5.0)
    s = soak.Soak(a, "http://127.0.0.1:1", {}, cast(Any, None), tmp_path / "samples.jsonl")
    s.samples = [{**_sample(t, replica_Ingress=100_000 + t, ray_gcs=50_000), "status": None} for t in range(0, 70, 10)]
    s.tally = Counter({("normal", "ok"): 5, ("fault error_500", "bad_engine_response"): 1})
    s.statuses = Counter({"200": 5, "502": 1})
    s.completed, s.sent, s.done = 5, 6, 6
    s.final_status, s.quiesce_s = SNAP, 1.5
    s.episodes = [{"start_s": 45.0, "end_s": 50.0, "engine": "u", "fault": "unhealthy", "on_status": 200,
                   "off_status": 200}]
    res, text, checks = soak_report.report(a, s)
    assert all(c["verdict"] == "PASS" for c in checks)
    assert "first sample at or after 6 s = 10 % of the load, here t = 10" in text
    assert "unhealthy on u" in text and "balanced" in text and "client_disconnected" in text
    assert res["client"]["status_codes"] == {"200": 5, "502": 1} and res["router"]["books"]["balanced"]
    json.dumps(res)  # serializable


def test_cli_builds_soak_args() -> None:
    ns = build_parser().parse_args(["soak", "--minutes", "3", "--concurrency", "8", "--sample-s", "5",
                                    "--fault-rate", "0.2", "--out", "x.json", "--seed", "4", "--baseline-s", "60",
                                    "--ray-env", "RAY_SERVE_ENABLE_HA_PROXY=0"])
    a = soak_args(ns)
    assert (a.minutes, a.concurrency, a.sample_s, a.fault_rate, a.seed) == (3.0, 8, 5.0, 0.2, 4)
    assert a.load_s == 180.0 and a.baseline_at_s == 60.0 and ns.out == Path("x.json")
    assert a.ray_env == (("RAY_SERVE_ENABLE_HA_PROXY", "0"),)
    d = soak_args(build_parser().parse_args(["soak"]))
    assert (d.minutes, d.concurrency, d.sample_s, d.baseline_s) == (30.0, 16, 10.0, None)
    assert d.baseline_at_s == 180.0  # 10 % of the load
    with pytest.raises(SystemExit):
        soak_args(build_parser().parse_args(["soak", "--fault-rate", "0.99"]))
