"""Run a simulated engine inside the current event loop: :func:`start_server`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass

import uvicorn

from narwhal_serve.sim.app import create_app, get_engine
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.engine import Engine
from narwhal_serve.sim.faults import SimulatedReset


class _DropSimulatedResets(logging.Filter):
    """Keep uvicorn from logging a traceback for every injected ``reset_mid_stream``."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, SimulatedReset):
                return False
            if isinstance(exc, BaseExceptionGroup) and any(isinstance(e, SimulatedReset) for e in exc.exceptions):
                return False
            exc = exc.__cause__ or exc.__context__
        return True


_FILTER = _DropSimulatedResets()


def quiet_simulated_resets() -> None:
    logging.getLogger("uvicorn.error").addFilter(_FILTER)


def uvicorn_config(cfg: SimEngineConfig, host: str, port: int) -> tuple[uvicorn.Config, Engine]:
    app = create_app(cfg)
    engine = get_engine(app)
    engine.port = port
    quiet_simulated_resets()
    config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2, timeout_keep_alive=30)
    return config, engine


@dataclass
class SimServer:
    """A running simulated engine; ``url`` is ``http://host:port`` (no trailing slash)."""

    url: str
    engine: Engine
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        """Release hanging requests, stop accepting, and wait for uvicorn to exit."""
        self.engine.shutdown()
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=5.0)
        except TimeoutError:
            self.server.force_exit = True
            await self.task


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket (binding here turns a busy port into ``OSError``, not ``SystemExit``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def start_server(cfg: SimEngineConfig, host: str, port: int) -> SimServer:
    """Start uvicorn serving ``cfg`` as a task of the running loop; return once it accepts connections.

    Raises ``OSError`` if ``host:port`` cannot be bound.  Port 0 picks a free port (see ``url``).
    """
    sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    config, engine = uvicorn_config(cfg, host, port)
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"narwhal-sim-{cfg.name}")
    for _ in range(1000):  # up to ~10 s
        if server.started:
            netloc = f"[{host}]" if ":" in host else host
            return SimServer(f"http://{netloc}:{port}", engine, server, task)
        if task.done():
            break
        await asyncio.sleep(0.01)
    server.should_exit = True
    try:
        await asyncio.wait_for(task, timeout=5.0)
    finally:
        sock.close()
    raise RuntimeError(f"narwhal-sim {cfg.name} failed to start on {host}:{port}")
