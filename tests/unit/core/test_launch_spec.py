"""Launch specs of managed engines: start-up errors name the key; argv, environment and Serve
options for each kind; tensor-parallel bundles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from narwhal_serve.config import NarwhalConfig, format_validation_error
from narwhal_serve.managed.command import (
    GUARD,
    deployment_names,
    deployment_options,
    engine_argv,
    engine_env,
    guarded,
    url_host,
)
from narwhal_serve.config.launch import LaunchSpec

VLLM = {"kind": "vllm", "model": "/models/tiny"}


def engine(**launch: Any) -> dict[str, Any]:
    return {"name": "e", "launch": launch}


def error_of(args: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as exc:
        NarwhalConfig.model_validate(args)
    return format_validation_error(exc.value)


@pytest.mark.parametrize("entry,needles", [
    ({"name": "e"}, ["engines.0", "exactly one of `url`", "`launch`", "neither"]),
    ({"name": "e", "url": "http://x", "launch": VLLM}, ["engines.0", "not both"]),
    (engine(kind="vllm"), ["engines.0.launch", "launch.model is required with launch.kind: vllm"]),
    (engine(kind="sglang"), ["launch.model is required with launch.kind: sglang"]),
    (engine(kind="sim", model="m"), ["launch.model is not used with launch.kind: sim"]),
    (engine(kind="command"), ["launch.command is required with launch.kind: command"]),
    (engine(kind="vllm", model="m", command=["x"]), ["launch.command is only used with launch.kind: command"]),
    (engine(kind="command", command=["srv", "--port={prt}"]), ["unknown placeholder {prt}"]),
    (engine(kind="sim", python="/usr/bin/python3", venv="/v"), ["launch.python and launch.venv"]),
    (engine(kind="sim", resources={"num_gpus": -1}), ["engines.0.launch.resources.num_gpus"]),
    (engine(kind="sim", resources={"gpus": 1}), ["unknown config key 'engines.0.launch.resources.gpus'"]),
    (engine(kind="sim", replica=2), ["unknown config key 'engines.0.launch.replica'"]),
    (engine(kind="sim", replicas=0), ["engines.0.launch.replicas"]),
    (engine(kind="bogus"), ["engines.0.launch.kind"]),
    (engine(kind="sim", tensor_parallel_size=2, resources={"num_gpus": 2}, placement_strategy="SPREAD"),
     ["launch.placement_strategy: SPREAD", "STRICT_PACK"]),
    (engine(kind="sim", tensor_parallel_size=2, resources={"num_gpus": 3}),
     ["launch.resources.num_gpus (3) must be a multiple of launch.tensor_parallel_size (2)"]),
    (engine(kind="sim", placement_strategy="SIDEWAYS"), ["engines.0.launch.placement_strategy"]),
    (engine(kind="sim", resources={"custom": {"zone_a": -1}}), ["launch.resources.custom"]),
    (engine(kind="sim", env={"A=B": "1"}), ["launch.env: invalid variable names"]),
])
def test_launch_spec_errors_name_the_key(entry: dict[str, Any], needles: list[str]) -> None:
    msg = error_of({"engines": [entry]})
    for needle in needles:
        assert needle in msg, msg


def test_replica_slot_names_must_not_clash_with_other_engines() -> None:
    msg = error_of({"engines": [engine(kind="sim", replicas=2), {"name": "e-1", "url": "http://x"}]})
    assert "names must be unique" in msg and "e-1" in msg


def test_managed_and_url_engines_side_by_side() -> None:
    cfg = NarwhalConfig.model_validate({"engines": [
        {"name": "m", "role": "unified", "launch": {"kind": "sim", "replicas": 2}},
        {"name": "u", "url": "http://127.0.0.1:9"},
    ]})
    assert [e.names() for e in cfg.engines] == [["m-0", "m-1"], ["u"]]
    assert cfg.engines[0].url == "" and cfg.engines[0].launch is not None
    with pytest.raises(ValueError, match="no URL yet"):
        cfg.engines[0].base_url  # noqa: B018


# ----------------------------------------------------------------------------- argv


def test_vllm_argv() -> None:
    spec = LaunchSpec(kind="vllm", model="/m/tiny", args=("--max-model-len", "512"), venv="/opt/vllm")
    argv = engine_argv(spec, name="v0", model="tiny", role="unified", dialect="vllm", host="127.0.0.1", port=8123,
                       python=spec.interpreter("/usr/bin/python3"))
    assert argv == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                    "--port", "8123", "--model", "/m/tiny", "--served-model-name", "tiny",
                    "--max-model-len", "512"]


def test_vllm_and_sglang_tensor_parallel_flags() -> None:
    kw: dict[str, Any] = {"name": "g", "model": "llama", "role": "unified", "dialect": "vllm", "host": "10.0.0.5",
                          "port": 9000, "python": "py"}
    vllm = LaunchSpec(kind="vllm", model="meta/llama", tensor_parallel_size=4, resources={"num_gpus": 4})
    assert engine_argv(vllm, **kw)[-2:] == ["--tensor-parallel-size", "4"]
    sgl = LaunchSpec(kind="sglang", model="meta/llama", tensor_parallel_size=2, resources={"num_gpus": 2})
    assert engine_argv(sgl, **kw) == ["py", "-m", "sglang.launch_server", "--host", "10.0.0.5", "--port", "9000",
                                      "--model-path", "meta/llama", "--served-model-name", "llama", "--enable-metrics",
                                      "--tp-size", "2"]


def test_sim_argv_serves_the_config_model_under_the_engine_name() -> None:
    spec = LaunchSpec(kind="sim", args=("--tpot-base-s", "0.01"))
    argv = engine_argv(spec, name="za", model="narwhal-sim", role="decode", dialect="sglang", host="h", port=1,
                       python="py")
    assert argv == ["py", "-m", "narwhal_serve.sim.cli", "--host", "h", "--port", "1", "--name", "za", "--role",
                    "decode", "--dialect", "sglang", "--model", "narwhal-sim", "--tpot-base-s", "0.01"]


def test_priority_scheduling_flags() -> None:
    kw: dict[str, Any] = {"name": "g", "model": "m", "role": "unified", "dialect": "vllm", "host": "h", "port": 1,
                          "python": "py", "priority": True}
    assert engine_argv(LaunchSpec(kind="vllm", model="/m"), **kw)[-2:] == ["--scheduling-policy", "priority"]
    # SGLang runs higher values first unless told otherwise: Narwhal sends 0 for the top class
    assert engine_argv(LaunchSpec(kind="sglang", model="/m"), **kw)[-2:] == [
        "--enable-priority-scheduling", "--schedule-low-priority-values-first"]
    sim = engine_argv(LaunchSpec(kind="sim"), **kw)
    assert sim[-2:] == ["--scheduling-policy", "priority"]
    from narwhal_serve.sim.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(sim[3:])).priority_scheduling


def test_command_placeholders() -> None:
    spec = LaunchSpec(kind="command", command=("{python}", "-m", "srv", "--bind={host}:{port}", "--n", "{name}",
                                               "--tp", "{tp}", "--model", "{model}"), args=("-v",))
    argv = engine_argv(spec, name="c", model="m", role="unified", dialect="openai", host="0.0.0.0", port=7,
                       python="py")
    assert argv == ["py", "-m", "srv", "--bind=0.0.0.0:7", "--n", "c", "--tp", "1", "--model", "m", "-v"]


def test_guard_execs_the_engine_after_asking_for_a_parent_death_signal() -> None:
    argv = guarded(["py", "-m", "x"], 42, "/usr/bin/python3")
    assert argv[:3] == ["/usr/bin/python3", "-I", "-c"] and argv[3] == GUARD and argv[4:] == ["42", "py", "-m", "x"]
    assert "prctl(1" in GUARD and "os.execvp" in GUARD


# ----------------------------------------------------------------------------- environment


def test_env_for_a_venv_engine_drops_the_routers_python_path() -> None:
    spec = LaunchSpec(kind="vllm", model="m", venv="/opt/vllm", resources={"num_cpus": 1},
                      env={"VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": "3"})
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/router", "VIRTUAL_ENV": "/router/.venv", "OMP_NUM_THREADS": "1",
            "KEEP": "x"}
    env = engine_env(spec, base, current_python="/router/.venv/bin/python")
    assert "PYTHONPATH" not in env and env["VIRTUAL_ENV"] == "/opt/vllm"
    assert env["PATH"] == "/opt/vllm/bin:/usr/bin" and env["KEEP"] == "x"
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["OMP_NUM_THREADS"] == "3"  # launch.env wins


def test_env_threads_and_gpus() -> None:
    cpu = LaunchSpec(kind="sim", resources={"num_cpus": 2.5})
    env = engine_env(cpu, {"PYTHONPATH": "/r", "OMP_NUM_THREADS": "1"}, current_python="py", gpu_ids=["3"])
    assert env["OMP_NUM_THREADS"] == "2" and env["PYTHONPATH"] == "/r" and "CUDA_VISIBLE_DEVICES" not in env
    zero = LaunchSpec(kind="sim", resources={"num_cpus": 0})
    assert engine_env(zero, {}, current_python="py")["OMP_NUM_THREADS"] == "1"
    gpu = LaunchSpec(kind="vllm", model="m", tensor_parallel_size=2, resources={"num_gpus": 2})
    assert engine_env(gpu, {"CUDA_VISIBLE_DEVICES": "0"}, current_python="py",
                      gpu_ids=["0", "5"])["CUDA_VISIBLE_DEVICES"] == "0,5"


# ----------------------------------------------------------------------------- Serve options


def test_cpu_engine_options() -> None:
    spec = LaunchSpec(kind="vllm", model="m", replicas=2, resources={"num_cpus": 1, "custom": {"zone_a": 1}},
                      health_check_period_s=1.0, stop_grace_s=5)
    opts = deployment_options(spec)
    assert opts["num_replicas"] == 2 and opts["health_check_period_s"] == 1.0
    assert opts["graceful_shutdown_timeout_s"] == 15.0
    assert opts["ray_actor_options"] == {"num_cpus": 1, "resources": {"zone_a": 1}}
    assert "placement_group_bundles" not in opts


def test_one_gpu_engine_options() -> None:
    spec = LaunchSpec(kind="vllm", model="m", resources={"num_cpus": 4, "num_gpus": 1, "accelerator_type": "L4"})
    assert deployment_options(spec)["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1, "accelerator_type": "L4"}


def test_tensor_parallel_bundles() -> None:
    spec = LaunchSpec(kind="vllm", model="m", tensor_parallel_size=4,
                      resources={"num_cpus": 8, "num_gpus": 4, "accelerator_type": "H100", "custom": {"rack": 1}})
    opts = deployment_options(spec)
    extra = {"rack": 1, "accelerator_type:H100": 0.001}
    assert opts["placement_group_bundles"] == [{"CPU": 8, "GPU": 1, **extra}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 8, "num_gpus": 1, "resources": extra}  # fits bundle 0


def test_tensor_parallel_on_cpu_needs_no_bundles() -> None:
    spec = LaunchSpec(kind="vllm", model="m", tensor_parallel_size=2, resources={"num_cpus": 2})
    assert not spec.uses_placement_group and "placement_group_bundles" not in deployment_options(spec)


def test_deployment_names_are_safe_and_unique() -> None:
    assert deployment_names(["a b", "a_b", "v0"]) == ["Engine-a_b", "Engine-a_b-2", "Engine-v0"]


def test_url_host() -> None:
    assert url_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert url_host("127.0.0.1", "10.1.2.3") == "127.0.0.1"
    assert url_host("::", "fe80::1") == "[fe80::1]"


def test_relative_paths_resolve_against_the_start_directory(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    spec = LaunchSpec(kind="vllm", model="models/tiny", venv=".cache/vllm-venv", log_dir="logs")
    r = spec.resolved(tmp_path)
    assert r.model == str(tmp_path / "models" / "tiny") and r.venv == str(tmp_path / ".cache" / "vllm-venv")
    assert r.log_dir == str(tmp_path / "logs")
    hub = LaunchSpec(kind="vllm", model="meta-llama/Llama-3.1-8B", python="python3").resolved(tmp_path)
    assert hub.model == "meta-llama/Llama-3.1-8B" and hub.python == "python3"  # ids and PATH names stay


def test_managed_engines_publish_kv_events_on_sockets_the_router_can_reach() -> None:
    import json

    from narwhal_serve.managed.command import kv_event_endpoints, kv_events_wanted

    assert kv_events_wanted(LaunchSpec(kind="vllm", model="m")) and kv_events_wanted(LaunchSpec(kind="sim"))
    assert not kv_events_wanted(LaunchSpec(kind="vllm", model="m", kv_events=False))
    assert not kv_events_wanted(LaunchSpec(kind="sglang", model="m"))
    # loopback-bound: Unix sockets (vLLM binds ipc://, it would connect to tcp://127.0.0.1:P)
    # named after the engine start's token, not a port: a Unix socket does not hold a port, so two
    # engines on a node could be given the same one (the ports are only free when chosen)
    bind, reach = kv_event_endpoints("127.0.0.1", "10.0.0.5", (5001, 5002), "ab12")
    assert bind == reach == ("ipc:///tmp/narwhal-kv-ab12.pub", "ipc:///tmp/narwhal-kv-ab12.replay")
    assert kv_event_endpoints("127.0.0.1", "10.0.0.5", (5001, 5002), "cd34")[0] != bind
    # on the node's address: vLLM binds *, the router connects to the node
    bind, reach = kv_event_endpoints("0.0.0.0", "10.0.0.5", (5001, 5002), "ab12")
    assert bind == ("tcp://*:5001", "tcp://*:5002") and reach == ("tcp://10.0.0.5:5001", "tcp://10.0.0.5:5002")
    kw: dict[str, Any] = {"name": "g", "model": "tiny", "role": "unified", "dialect": "vllm", "host": "10.0.0.5",
                          "port": 9000, "python": "py", "kv_events": bind}
    argv = engine_argv(LaunchSpec(kind="vllm", model="m"), **kw)
    cfg = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5001",
                   "replay_endpoint": "tcp://*:5002"}
    sim = engine_argv(LaunchSpec(kind="sim"), **kw)
    assert sim[sim.index("--kv-events-endpoint") + 1] == "tcp://*:5001"
    assert sim[sim.index("--kv-events-replay-endpoint") + 1] == "tcp://*:5002"
