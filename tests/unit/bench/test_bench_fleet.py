"""Pure parts of the fleet, the modes and the CLI: configs, capacity, checks, /proc CPU, tables."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from narwhal_serve.bench import procs
from narwhal_serve.bench.cli import build_parser, fleet_spec, goodput_args
from narwhal_serve.bench.fleet import NARWHAL_PREFIX, SimTiming, narwhal_serve_config
from narwhal_serve.bench.goodput import GoodputArgs, goodput_checks, model_capacity, rate_plan
from narwhal_serve.bench.report import check, plot_lines, table
from narwhal_serve.bench.workload import LengthDist, Workload
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.sim.cli import build_parser as sim_parser
from narwhal_serve.sim.cli import config_from_args


def test_serve_config_validates_as_narwhal_args() -> None:
    cfg = narwhal_serve_config(8123, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "m",
                               ["narwhal-open", "narwhal-predictive"], ttft_budget_s=0.5)
    assert cfg["http_options"] == {"host": "127.0.0.1", "port": 8123}
    modes = []
    for app in cfg["applications"]:
        assert app["route_prefix"] == NARWHAL_PREFIX[app["name"]]
        args = NarwhalConfig.model_validate(app["args"])
        assert [(e.role, e.dialect) for e in args.engines] == [("unified", "vllm")] * 2
        assert args.admission.ttft_budget_s == 0.5
        modes.append(args.admission.mode)
    assert modes == ["open", "predictive"]


def test_sim_timing_argv_round_trips_through_narwhal_sim() -> None:
    t = SimTiming(0.01, 0.0002, 0.02, 0.003, 7)
    cfg = config_from_args(sim_parser().parse_args(["--port", "1", *t.argv()]))
    assert (cfg.prefill_overhead_s, cfg.prefill_per_token_s, cfg.tpot_base_s, cfg.tpot_per_running_s,
            cfg.max_num_seqs) == (0.01, 0.0002, 0.02, 0.003, 7)


def test_model_capacity_littles_law() -> None:
    t = SimTiming(prefill_overhead_s=0.1, prefill_per_token_s=0.0, tpot_base_s=0.01, tpot_per_running_s=0.01,
                  max_num_seqs=4)
    wl = Workload(LengthDist(10, 0, 10, 10), LengthDist(11, 0, 11, 11))
    # service = 0.1 + 10 * (0.01 + 0.04) = 0.6 s; 2 engines x 4 slots / 0.6
    assert model_capacity(t, 2, wl) == pytest.approx(8 / 0.6)


def test_rate_plan() -> None:
    assert rate_plan(GoodputArgs(rates=[0.5, 2.0]), 10.0) == [(0.5, 5.0), (2.0, 20.0)]
    assert rate_plan(GoodputArgs(rates_rps=[5.0]), 10.0) == [(0.5, 5.0)]


def _row(target: str, load: float, goodput: float, attain: float, refused: float) -> dict[str, object]:
    return {"target": target, "load": load, "goodput_rps": goodput, "slo_attainment_admitted": attain,
            "refusal_rate": refused}


def test_goodput_checks() -> None:
    rows = [_row("narwhal-predictive", 0.8, 8.0, 1.0, 0.0), _row("narwhal-predictive", 2.0, 9.5, 0.995, 0.5),
            _row("rr", 2.0, 2.0, 0.2, 0.0)]
    verdicts = {c["check"]: c["verdict"] for c in goodput_checks(rows, 10.0)}  # type: ignore[arg-type]
    assert verdicts == {
        "predictive goodput / capacity at 2.0x": "PASS",
        "predictive goodput / rr at 2.0x": "PASS",
        "predictive admitted within SLO (worst load)": "PASS",
        "predictive refused at 0.8x": "PASS",
    }
    assert check("x", None, "<=", 1)["verdict"] == "n/a"
    assert check("x", 2.0, "<=", 1)["verdict"] == "MISS"


def test_tree_cpu_of_this_process() -> None:
    snap = procs.tree_cpu(os.getpid())
    assert os.getpid() in snap and snap[os.getpid()][1] > 0
    assert procs.cpu_delta({1: ("a", 1.0)}, {1: ("a", 1.5), 2: ("b", 0.25)}) == {"a": 0.5, "b": 0.25}
    assert 0 < procs.free_port() < 65536


def test_free_ports_avoid_the_ephemeral_range_and_never_repeat() -> None:
    import socket

    from narwhal_serve import ports as net

    lo, _ = net._ephemeral()
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(p < lo for p in ports)  # nothing another process's bind(0) takes
    for p in ports[:5]:  # and free when handed out
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
    run = procs.free_port_run(3, start=ports[0] - 1)  # a run never overlaps a port handed out
    assert ports[0] not in range(run, run + 3)
    assert procs.free_port_run(3, start=run) != run and procs.free_port() not in range(run, run + 3)
    try:  # a managed engine's host may be IPv6 (where this machine has it)
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s6:
            s6.bind(("::1", 0))
    except OSError:
        return
    v6 = net.free_port("::1")
    assert v6 < lo and v6 not in ports


def test_table_and_plot(tmp_path: Path) -> None:
    t = table(["a", "bb"], [["x", 1.2345], [None, 10]])
    assert t.splitlines() == ["a    bb", "-  ----", "x  1.23", "-    10"]
    pytest.importorskip("matplotlib")
    p = plot_lines(tmp_path / "p.png", "t", "x", "y", {"a": [(1.0, 2.0), (2.0, None), (3.0, 1.0)]})
    assert p is not None and p.read_bytes()[:4] == b"\x89PNG"


def test_cli_defaults_and_targets() -> None:
    ns = build_parser().parse_args(["goodput", "--targets", "rr,narwhal-predictive", "--slo-ttft-ms", "500",
                                    "--tpot-base-s", "0.03"])
    assert ns.targets == ["rr", "narwhal-predictive"]
    spec = fleet_spec(ns, 0.5)
    assert spec.engines == 2 and spec.timing.tpot_base_s == 0.03 and spec.timing.max_num_seqs == 4
    assert goodput_args(ns).slo.ttft_s == 0.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["overhead", "--targets", "nope"])


def test_baseline_targets_and_their_config(tmp_path: Path) -> None:
    from narwhal_serve.bench.fleet import Fleet, FleetSpec, base_of, known_target

    assert base_of("narwhal-predictive@base") == "narwhal-predictive"
    assert base_of("direct@base") is None and base_of("narwhal-predictive") is None
    assert known_target("narwhal-open@base") and not known_target("proxy@base")
    ns = build_parser().parse_args(["overhead", "--targets", "direct,narwhal-predictive@base",
                                    "--baseline-tree", str(tmp_path), "--tokenizer", str(tmp_path)])
    spec = fleet_spec(ns, 2.0)
    assert spec.baseline_tree == tmp_path and spec.tokenizer == str(tmp_path.resolve())
    fleet = Fleet(FleetSpec(), tmp_path / "logs")
    assert fleet.process("narwhal-predictive@base") is fleet.baseline is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["overhead", "--targets", "proxy@base"])
    # the Assembler shape as a target: the same application with deployment.relay: assembler
    cfg = narwhal_serve_config(8000, ["http://127.0.0.1:1"], "m", ["narwhal-assembler"], 2.0)
    args = NarwhalConfig.model_validate(cfg["applications"][0]["args"])
    assert args.deployment.relay == "assembler" and args.admission.mode == "predictive"


@pytest.mark.skipif(__import__("narwhal_serve.runenv", fromlist=["real_haproxy"]).real_haproxy() is None,
                    reason="no HAProxy binary")
def test_a_baseline_tree_runs_behind_its_own_haproxy_wrapper(tmp_path: Path) -> None:
    """The wrapper's rules are part of a build: a tree whose runenv writes other rules gets its
    own wrapper (here a copy of this package with one rule changed), a tree that cannot write one
    the fallback."""
    import shutil

    from narwhal_serve.bench.fleet import app_dir, tree_wrapper

    tree = tmp_path / "tree"
    shutil.copytree(app_dir() / "narwhal_serve", tree / "narwhal_serve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    runenv = tree / "narwhal_serve" / "runenv.py"
    runenv.write_text(runenv.read_text().replace("del-header x-request-disconnect-disabled",
                                                 "set-header x-request-disconnect-disabled ?1"))
    theirs = Path(tree_wrapper(tree, tmp_path / "theirs", "fallback"))
    assert theirs.parent == tmp_path / "theirs"
    assert "set-header x-request-disconnect-disabled ?1" in theirs.read_text()
    ours = Path(tree_wrapper(app_dir(), tmp_path / "ours", "fallback"))
    assert "del-header x-request-disconnect-disabled" in ours.read_text()
    assert tree_wrapper(tmp_path / "empty", tmp_path / "none", "fallback") == "fallback"
