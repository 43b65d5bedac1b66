"""Child processes the bench starts (simulated engines, the proxy, ``serve run``), stopped by PID,
and CPU time of a process tree read from ``/proc``.

Every process is started in its own session with SIGINT at its default disposition (a shell that
runs the bench in the background would otherwise hand it down ignored, and ``serve run`` would not
shut Ray down).  ``stop`` signals the process, waits, escalates to SIGTERM, then SIGKILLs the
process and every descendant it had, each by PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from narwhal_serve.ports import free_port, free_port_run

__all__ = ["free_port", "free_port_run"]  # (from narwhal_serve.ports: the bench modules use them as procs.free_port)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> tuple[int, float, str] | None:
    """(ppid, cpu seconds user+system, comm) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    lpar, rpar = raw.find("("), raw.rfind(")")
    comm = raw[lpar + 1 : rpar]
    rest = raw[rpar + 2 :].split()
    # rest[0] is field 3 (state): ppid is field 4, utime 14, stime 15
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _CLK_TCK, comm


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """PIDs of ``root``'s live descendants (one /proc scan)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _proc_stat(int(entry.name))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry.name))
    out: list[int] = []
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def process_label(pid: int) -> str:
    """A short role name: the Ray actor title (``ray::ServeReplica:app:Ingress``) or the program."""
    cmd = _cmdline(pid)
    if cmd.startswith("ray::"):
        return cmd.split()[0].split(".")[0]  # drop the method Ray appends while one runs
    st = _proc_stat(pid)
    comm = st[2] if st else "?"
    for key in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "serve run", "serve"):
        if key in cmd:
            return key.replace(".py", "")
    return comm


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """``{pid: (label, cpu seconds)}`` for ``root`` and its live descendants."""
    out: dict[int, tuple[str, float]] = {}
    for pid in [root, *descendants(root)]:
        st = _proc_stat(pid)
        if st is not None:
            out[pid] = (process_label(pid), st[1])
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two :func:`tree_cpu` snapshots, summed per label."""
    out: dict[str, float] = {}
    for pid, (label, cpu) in after.items():
        spent = cpu - (before[pid][1] if pid in before else 0.0)
        out[label] = out.get(label, 0.0) + max(0.0, spent)
    return out


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Managed:
    """A started child: its Popen, what it is, where its output goes."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    known: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def remember_tree(self) -> None:
        if self.alive():
            self.known.update(descendants(self.pid))

    def stop(self, first: int = signal.SIGTERM, grace_s: float = 10.0, term_s: float = 10.0) -> None:
        self.remember_tree()
        for sig, wait in ((first, grace_s), (signal.SIGTERM, term_s)):
            if not self.alive():
                break
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        if self.alive():
            self.popen.kill()
            self.popen.wait(timeout=10)
        time.sleep(0.2)
        for pid in self.known:  # Ray workers outliving their driver: ours, by PID
            if _proc_stat(pid) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def start(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> Managed:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with log.open("ab") as fh:
        popen = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
                                 preexec_fn=_default_sigint)
    return Managed(name, popen, log)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def http_status(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (127.0.0.1 only)
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0


def wait_ready(url: str, timeout_s: float, proc: Managed | None = None, every_s: float = 0.5) -> float:
    """Poll ``url`` until it answers 200; return the seconds it took.  Raises ``RuntimeError`` on
    timeout or when ``proc`` exits first (naming its log)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if http_status(url) == 200:
            return time.monotonic() - t0
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before {url} was ready; see {proc.log}")
        time.sleep(every_s)
    where = f"; see {proc.log}" if proc is not None else ""
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s{where}")


def parse_vm_rss(status_text: str) -> int | None:
    """``VmRSS`` in kB from a ``/proc/PID/status`` text (None for kernel threads and zombies)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            parts = line.split()
            return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
    return None


def rss_kb(pid: int) -> int | None:
    """A live process's resident memory in kB (None once it is gone)."""
    try:
        return parse_vm_rss(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
