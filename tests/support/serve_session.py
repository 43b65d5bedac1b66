"""One Ray + Serve session per test process (call :func:`tests.support.ray_env.apply` first)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.net import free_port


@contextmanager
def serve_session() -> Iterator[int]:
    """A local Ray instance and Serve's HTTP entry on a free 127.0.0.1 port (yielded); both shut
    down on exit. Apps are deployed by the caller with ``serve.run``."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield port
        finally:
            serve.shutdown()
    finally:
        ray.shutdown()
