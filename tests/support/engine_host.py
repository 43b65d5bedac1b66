"""Simulated engines a test can stop, restart, kill and freeze.

:class:`EngineHost` serves in-process engines from a thread with its own event loop, so they keep
answering while the test process blocks (``serve.run``, ``ray.kill``, pytest between tests).
:class:`EngineProcess` runs one engine as a ``narwhal-sim`` child process, for faults only a
process has: SIGKILL (the connection dies with it) and SIGSTOP (it accepts, then never answers).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from narwhal_serve.bench.procs import Managed, python_module, start, wait_ready
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.server import SimServer, start_server

T = TypeVar("T")
HOST = "127.0.0.1"


class EngineHost:
    """In-process simulated engines, each on its own port, served from one background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sim-engines", daemon=True)
        self._thread.start()
        self.servers: dict[str, SimServer] = {}
        self.configs: dict[str, tuple[SimEngineConfig, int]] = {}

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _acall(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def start(self, cfg: SimEngineConfig, port: int = 0) -> str:
        """Start ``cfg`` (on ``port``, or a free one); its URL."""
        srv = self._call(start_server(cfg, HOST, port))
        self.servers[cfg.name] = srv
        self.configs[cfg.name] = (cfg, int(srv.url.rsplit(":", 1)[1]))
        return srv.url

    async def stop(self, name: str) -> None:
        """Stop accepting (the port then refuses connections); hanging requests are released."""
        await self._acall(self.servers.pop(name).stop())

    async def restart(self, name: str) -> None:
        """A fresh engine (empty state) with the same config on the same port."""
        if name in self.servers:
            await self.stop(name)
        cfg, port = self.configs[name]
        self.servers[name] = await self._acall(start_server(cfg, HOST, port))

    def close(self) -> None:
        for name in list(self.servers):
            self._call(self.servers.pop(name).stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class EngineProcess:
    """One ``narwhal-sim`` child process on a fixed port (restartable after a kill)."""

    def __init__(self, name: str, port: int, *args: str) -> None:
        self.name, self.port, self.args = name, port, args
        self.url = f"http://{HOST}:{port}"
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"narwhal-{name}-"))
        self.proc: Managed | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        argv = python_module("narwhal_serve.sim.cli", "--host", HOST, "--port", str(self.port),
                             "--name", self.name, *self.args)
        self.proc = start(self.name, argv, self.log_dir, cwd=Path(__file__).resolve().parents[2])
        wait_ready(self.url + "/health", timeout_s, self.proc, every_s=0.1)

    def signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.alive(), f"{self.name} is not running"
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: every connection to the engine is reset at once."""
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.popen.wait(timeout=10)

    def freeze(self) -> None:
        """SIGSTOP: connections are still accepted (by the kernel), nothing is ever answered."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.alive():
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.stop(grace_s=5.0, term_s=5.0)
        shutil.rmtree(self.log_dir, ignore_errors=True)
