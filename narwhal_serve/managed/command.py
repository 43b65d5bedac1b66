"""Pure builders for one managed engine: its argv, its environment, its Serve deployment options.

No I/O and no Ray: ``deployments/engine.py`` gathers the facts (node address, accelerator IDs, a
free port) and calls these.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from narwhal_serve.config.launch import LaunchSpec

# Serve's own per-call bookkeeping is all that reaches a replica: control calls, never requests.
MAX_ONGOING = 8
HEALTH_HTTP_TIMEOUT_S = 5.0  # a replica's check of its engine's /health

# Run as ``python -I -c GUARD <parent pid> argv...``: ask Linux to SIGTERM the engine when the thread
# that spawned it (the replica's event loop) dies, then exec the engine (same PID, the signal
# request survives exec).  A replica killed outright (no __del__) leaves no engine behind.
GUARD = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))\n"  # PR_SET_PDEATHSIG
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(70)\n"  # the replica died before the request took effect
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def kv_events_wanted(spec: LaunchSpec) -> bool:
    """Whether the engine is started publishing KV events (vLLM and the simulator can)."""
    return spec.kv_events and spec.kind in ("vllm", "sim")


def kv_event_endpoints(
    host: str, node_ip: str, ports: tuple[int, int], token: str
) -> tuple[tuple[str, str], tuple[str, str]]:
    """(what the engine binds, what the router connects to) for its PUB and replay sockets.  vLLM binds
    only wildcard and ipc endpoints (it connects to any other): an engine bound to loopback (reachable
    from its own node only) gets Unix sockets named after ``token`` (unique to this engine start: two
    engines on a node must never share a socket file, and a port is not bound by a Unix socket, so
    nothing else keeps its name free), any other binds ``*`` on ``ports``."""
    if host.startswith("127.") or host in ("localhost", "::1"):
        ends = (f"ipc:///tmp/narwhal-kv-{token}.pub", f"ipc:///tmp/narwhal-kv-{token}.replay")
        return ends, ends
    reach = url_host(host, node_ip)
    bind = (f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}")
    return bind, (f"tcp://{reach}:{ports[0]}", f"tcp://{reach}:{ports[1]}")


def engine_argv(
    spec: LaunchSpec, *, name: str, model: str, role: str, dialect: str, host: str, port: int, python: str,
    kv_events: tuple[str, str] | None = None, priority: bool = False,
) -> list[str]:
    """The engine's command line (``model`` is the name Narwhal serves and sends to engines;
    ``kv_events``: the PUB and replay endpoints it binds for its KV-cache events; ``priority``: it
    schedules by request priority, the engine's ``priority_scheduling``)."""
    tp = spec.tensor_parallel_size
    if spec.kind == "vllm":
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port),
                "--model", str(spec.model), "--served-model-name", model]
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        if kv_events is not None:
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events[0],
                   "replay_endpoint": kv_events[1]}
            argv += ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]
        if priority:
            argv += ["--scheduling-policy", "priority"]
    elif spec.kind == "sglang":
        # SGLang serves /metrics (what eligibility reads) only with --enable-metrics
        argv = [python, "-m", "sglang.launch_server", "--host", host, "--port", str(port),
                "--model-path", str(spec.model), "--served-model-name", model, "--enable-metrics"]
        if tp > 1:
            argv += ["--tp-size", str(tp)]
        if priority:  # (SGLang runs higher values first unless told otherwise; Narwhal's 0 is the top class)
            argv += ["--enable-priority-scheduling", "--schedule-low-priority-values-first"]
    elif spec.kind == "sim":
        argv = [python, "-m", "narwhal_serve.sim.cli", "--host", host, "--port", str(port), "--name", name,
                "--role", role, "--dialect", dialect, "--model", model]
        if kv_events is not None:
            argv += ["--kv-events-endpoint", kv_events[0], "--kv-events-replay-endpoint", kv_events[1]]
        if priority:
            argv += ["--scheduling-policy", "priority"]
    else:
        values = {"host": host, "port": str(port), "model": spec.model or model, "name": name, "python": python,
                  "tp": str(tp)}
        argv = [a.format(**values) for a in spec.command or ()]
    return argv + list(spec.args)


def guard_prefix(parent_pid: int, python: str) -> list[str]:
    """What runs before the engine's argv: :data:`GUARD` (``python``: any interpreter; the engine
    replaces it)."""
    return [python, "-I", "-c", GUARD, str(parent_pid)]


def guarded(argv: Sequence[str], parent_pid: int, python: str) -> list[str]:
    return [*guard_prefix(parent_pid, python), *argv]


def engine_env(
    spec: LaunchSpec, base: Mapping[str, str], *, current_python: str, gpu_ids: Sequence[str] = ()
) -> dict[str, str]:
    """The engine's environment: the replica's (``base``), adjusted for its interpreter and
    resources, then ``launch.env`` (which wins).

    * another interpreter: no PYTHONPATH / PYTHONHOME of the router's; a venv also gets VIRTUAL_ENV
      and its bin/ first on PATH;
    * OMP_NUM_THREADS = the reserved CPUs (at least 1) — a process started from a Ray worker would
      otherwise inherit the worker's value (1 for a zero-CPU actor); none for vLLM on GPUs, which
      sizes its threads itself only then;
    * CUDA_VISIBLE_DEVICES = the GPUs Ray gave the replica (all bundles' with tensor parallelism);
      none (empty) for a vLLM or SGLang engine given no GPU;
    * SGLang: its /health without a generation (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``).
    """
    env = dict(base)
    if spec.interpreter(current_python) != current_python:
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        env.pop("VIRTUAL_ENV", None)
    if spec.venv is not None:
        env["VIRTUAL_ENV"] = spec.venv
        env["PATH"] = f"{spec.venv}/bin:{env.get('PATH', '/usr/bin:/bin')}"
    gpus = spec.resources.num_gpus > 0 and bool(gpu_ids)
    if spec.kind == "vllm" and gpus:
        # vLLM on GPUs sizes its threads itself only where OMP_NUM_THREADS is unset (one torch thread
        # a worker while serving: v1/executor/multiproc_executor.py, utils/torch_utils.py)
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = str(max(1, int(spec.resources.num_cpus)))
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    elif spec.kind in ("vllm", "sglang") and spec.resources.num_gpus == 0:
        # no GPU reserved, none seen: Ray 2.60 leaves a zero-GPU actor's CUDA_VISIBLE_DEVICES as the
        # node has it (every GPU), and the engine would take GPU 0 unreserved
        env["CUDA_VISIBLE_DEVICES"] = ""
    if spec.kind == "sglang":
        # SGLang's /health runs a one-token generation by default (up to 20 s under load, past the
        # replica's 5 s check): the plain answer (still 503 while it starts)
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"
    env.update(spec.env)
    return env


def _positive(d: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in d.items() if v > 0}


def deployment_options(spec: LaunchSpec) -> dict[str, Any]:
    """Keyword arguments of ``serve.deployment`` for the engine's deployment.

    Tensor parallelism on GPUs: one placement-group bundle per worker; the replica holds bundle 0
    (its CPUs, one worker's GPUs and the custom resources), the others hold one worker's GPUs
    each, placed by ``placement_strategy`` (STRICT_PACK: one node)."""
    r = spec.resources
    opts: dict[str, Any] = {
        "num_replicas": spec.replicas,
        "max_ongoing_requests": MAX_ONGOING,
        "health_check_period_s": spec.health_check_period_s,
        "health_check_timeout_s": max(10.0, 2 * HEALTH_HTTP_TIMEOUT_S),
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": spec.stop_grace_s + 10.0,
    }
    if spec.uses_placement_group:
        per = spec.gpus_per_worker
        extra = dict(r.custom)
        if r.accelerator_type:
            extra[f"accelerator_type:{r.accelerator_type}"] = 0.001  # as Ray's accelerator_type option asks
        first = _positive({"CPU": r.num_cpus, "GPU": per, **extra})
        opts["placement_group_bundles"] = [first] + [{"GPU": per}] * (spec.tensor_parallel_size - 1)
        opts["placement_group_strategy"] = spec.placement_strategy
        actor: dict[str, Any] = {"num_cpus": r.num_cpus, "num_gpus": per}
        if extra:
            actor["resources"] = extra
    else:
        actor = {"num_cpus": r.num_cpus}
        if r.num_gpus > 0:
            actor["num_gpus"] = r.num_gpus
        if r.accelerator_type:
            actor["accelerator_type"] = r.accelerator_type
        if r.custom:
            actor["resources"] = dict(r.custom)
    opts["ray_actor_options"] = actor
    return opts


def deployment_names(engines: Sequence[str]) -> list[str]:
    """One Serve deployment name per managed engine: ``Engine-<name>``, made safe and unique."""
    out: list[str] = []
    for name in engines:
        base = "Engine-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        cand, k = base, 1
        while cand in out:
            k += 1
            cand = f"{base}-{k}"
        out.append(cand)
    return out


def url_host(bind_host: str, node_ip: str) -> str:
    """The host part of the engine's URL: the bind address, or the node's address when it binds
    every interface."""
    host = node_ip if bind_host in ("", "0.0.0.0", "::") else bind_host
    return f"[{host}]" if ":" in host else host
