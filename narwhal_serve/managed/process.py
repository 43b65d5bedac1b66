"""One engine process, as a managed-engine replica runs it: start it in its own process group with
its output in a log file, wait until its ``/health`` answers, watch it, stop it (the whole group).

Plain asyncio and httpx, no Ray: tested with the simulated engine as the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from narwhal_serve.ports import remove_socket_files, socket_files


class EngineStartError(RuntimeError):
    """The engine exited, or did not answer ``/health``, before it was ready (message: why, and
    the last lines of its log)."""


class EngineDown(RuntimeError):
    """A started engine no longer serves (its process exited, or ``/health`` fails)."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class EngineProcess:
    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
                 cwd: str | None = None, prefix: Sequence[str] = (), leftovers: Sequence[str] = ()) -> None:
        self.name = name
        # files the engine makes and a stopped engine may leave behind (its ipc:// sockets, named
        # for this engine alone): removed once it has exited, as they were when it was ready
        # (narwhal_serve/ports.py socket_files), or, for an engine that never was, those it made
        self.leftovers = tuple(leftovers)
        self._left: tuple[tuple[str, tuple[int, int, int]], ...] = ()
        self._before: tuple[tuple[str, tuple[int, int, int]], ...] = ()  # there at its start: not its own
        self._ready = False
        self._swept = False
        self.argv = list(argv)
        self.prefix = list(prefix)  # run first, e.g. the parent-death guard (not shown in the log)
        self.env = dict(env)
        self.log_path = log_path
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.spawned_at: float | None = None  # time.monotonic() at spawn
        self._exit: asyncio.Future[int] | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def describe_exit(self) -> str:
        rc = self.returncode
        if rc is None:
            return f"engine {self.name} (pid {self.pid}) is running"
        if rc < 0:
            try:
                how = f"was killed by {signal.Signals(-rc).name}"
            except ValueError:  # (a signal the enum does not name: the real-time ones)
                how = f"was killed by signal {-rc}"
        else:
            how = f"exited with status {rc}"
        return f"engine {self.name} (pid {self.pid}) {how}"

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._before = socket_files(self.leftovers)
        with self.log_path.open("ab") as out:
            out.write(("$ " + " ".join(self.argv) + "\n").encode())
            out.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *self.prefix, *self.argv, stdout=out, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=True,  # its own process group: stop() ends all of it
            )
        self.spawned_at = time.monotonic()
        self._exit = asyncio.ensure_future(self.proc.wait())

    async def wait_exit(self) -> int:
        """Returns when the engine process exits (its return code)."""
        if self._exit is None:
            raise RuntimeError("not started")
        return await asyncio.shield(self._exit)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # its own engine, never through a proxy the environment names (HTTP_PROXY without the
            # node's address in NO_PROXY: /health asked of the proxy, the engine never ready)
            self._client = httpx.AsyncClient(timeout=5.0, trust_env=False)
        return self._client

    async def wait_ready(self, url: str, timeout_s: float, every_s: float = 0.5) -> float:
        """Seconds from spawn until ``GET url/health`` answered 200; :class:`EngineStartError` if
        the process exits first or ``timeout_s`` passes (the process is left to :meth:`stop`)."""
        if self._exit is None or self.spawned_at is None:
            raise RuntimeError("not started")
        deadline = self.spawned_at + timeout_s
        last = "no answer yet"
        while True:
            if self._exit.done():
                raise EngineStartError(f"{self.describe_exit()} before its /health answered; "
                                       f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                r = await self._http().get(url + "/health", timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                if r.status_code == 200:
                    self._left, self._ready = socket_files(self.leftovers), True
                    return time.monotonic() - self.spawned_at
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise EngineStartError(
                    f"engine {self.name} (pid {self.pid}) did not answer {url}/health with 200 within "
                    f"{timeout_s:g} s (last: {last}); raise launch.ready_timeout_s if it is only slow; "
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            # the exit is an event: a process that dies ends the wait at once
            await asyncio.wait({self._exit}, timeout=every_s)

    async def check(self, url: str, timeout_s: float) -> None:
        """:class:`EngineDown` unless the process runs and ``/health`` answers 200."""
        if not self.alive():
            raise EngineDown(f"{self.describe_exit()}; log {self.log_path}")
        try:
            r = await self._http().get(url + "/health", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise EngineDown(f"engine {self.name} (pid {self.pid}): /health failed: {type(exc).__name__}") from None
        if r.status_code != 200:
            raise EngineDown(f"engine {self.name} (pid {self.pid}): /health answered {r.status_code}")

    def _signal_group(self, sig: signal.Signals) -> bool:
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group's id is the engine's pid
            return True
        except (ProcessLookupError, PermissionError):
            return False

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the engine's process group, SIGKILL what is left after ``grace_s`` (or once the
        engine itself has exited: its children must not outlive it)."""
        try:
            if self.proc is not None and self._exit is not None:
                if not self._exit.done():
                    self._signal_group(signal.SIGTERM)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(self._exit), grace_s)
                self._signal_group(signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._exit), 5.0)
        finally:
            if self._client is not None:
                await self._client.aclose()
                self._client = None
            if self._exit is not None and self._exit.done() and not self._swept:
                self._swept = True  # (once: stop() runs again when its replica stops)
                left = self._left if self._ready else tuple(
                    f for f in socket_files(self.leftovers) if f not in self._before)
                remove_socket_files(left)
