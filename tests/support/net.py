"""Free loopback ports for tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_run(n: int, start: int = 20000, stop: int = 60000) -> int:
    """The first port p such that p..p+n-1 are all free on 127.0.0.1."""
    p = start
    while p + n < stop:
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            p += n
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port run")
