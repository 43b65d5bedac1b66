"""The run harness the long benchmarks share (``ramp``, ``soak``): one Narwhal run started from a
serve config written to the run's log folder, waited for until ``/ready``, and stopped whatever
happens — an exception, Ctrl-C or SIGTERM (turned into Ctrl-C while the run is up) — with both
interrupts ignored while it stops: an interrupted stop would leave Ray running."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from narwhal_serve.bench import procs


@dataclass(frozen=True)
class Stop:
    """How a run's process is stopped: ``first``, up to ``grace_s``; then SIGTERM, up to ``term_s``;
    then SIGKILL of what is left of its process tree."""

    first: int
    grace_s: float
    term_s: float


# `serve run`: SIGINT is Serve's clean shutdown
SERVE_RUN = Stop(signal.SIGINT, 30.0, 10.0)
# scripts/serve_run.py: SIGINT to `serve run` (Serve's clean shutdown), then its sweep of the run's leftovers
SUPERVISED = Stop(signal.SIGTERM, 90.0, 15.0)


@dataclass(frozen=True)
class Run:
    proc: procs.Managed
    base: str  # http://127.0.0.1:<port>
    startup_s: float  # from the start to /ready
    cfg_path: Path


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM as Ctrl-C. Raised here, not re-sent as SIGINT: a shell starts a background job with
    SIGINT ignored."""
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside: SIGTERM raises ``KeyboardInterrupt``, so that a benchmark stopped by its supervisor
    still stops its run and reports what it measured."""
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stop_uninterrupted(proc: procs.Managed, how: Stop, say: str | None = None) -> None:
    """Stop ``proc`` with interrupts ignored (``say``: a line for stderr, once they are)."""
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if say:
            print(say, file=sys.stderr, flush=True)
        proc.stop(first=how.first, grace_s=how.grace_s, term_s=how.term_s)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


@contextlib.contextmanager
def narwhal_run(argv: Sequence[str], cfg: dict[str, Any], port: int, log_dir: Path, *, env: dict[str, str],
                cwd: Path, start_timeout_s: float, stop: Stop, on_stop: str | None = None) -> Iterator[Run]:
    """``argv`` + the path of ``cfg`` (written as ``narwhal-serve-config.yaml``: JSON is YAML), ready
    on ``port``; stopped on the way out (``on_stop``: a line for stderr first)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = log_dir / "narwhal-serve-config.yaml"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    base = f"http://127.0.0.1:{port}"
    proc: procs.Managed | None = None
    try:
        proc = procs.start("narwhal", [*argv, str(cfg_path)], log_dir, env=env, cwd=cwd)
        startup_s = procs.wait_ready(base + "/ready", start_timeout_s, proc)
        proc.remember_tree()
        yield Run(proc, base, startup_s, cfg_path)
    finally:
        if proc is not None:
            stop_uninterrupted(proc, stop, on_stop)
