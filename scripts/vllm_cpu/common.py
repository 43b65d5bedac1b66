"""What every job of the vLLM-CPU tooling shares: the cache paths, phase timing and logging,
logged subprocesses and one HTTP helper (the standard library, and the router's own log tail)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from narwhal_serve.managed.process import log_tail

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("NARWHAL_CACHE_DIR") or REPO / ".cache")
VENV = CACHE / "vllm-venv"
MODEL_DIR = CACHE / "tiny-llama"
RUN_DIR = CACHE / "vllm-run"
RECORD_DIR = REPO / "tests" / "fixtures" / "vllm-recorded"

TIMINGS: dict[str, float] = {}


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
    return log_tail(path, lines)


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
