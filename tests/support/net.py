"""Free loopback ports for tests."""

from __future__ import annotations

import socket

from narwhal_serve.bench.procs import free_port_run

__all__ = ["free_port", "free_port_run"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
