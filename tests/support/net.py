"""Free loopback ports for tests (one copy: :mod:`narwhal_serve.bench.procs`)."""

from __future__ import annotations

from narwhal_serve.ports import free_port, free_port_run

__all__ = ["free_port", "free_port_run"]
