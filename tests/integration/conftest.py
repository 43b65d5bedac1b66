"""One Ray Serve graph for the whole integration session (started in-process with serve.run)."""

from __future__ import annotations

import os

for _k, _v in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    "NARWHAL_ADMIN_TOKEN": "test-admin-token",
}.items():
    os.environ.setdefault(_k, _v)

from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from tests.support.net import free_port, free_port_run  # noqa: E402

MODEL = "narwhal-sim"
ADMIN = {"Authorization": "Bearer test-admin-token"}


@dataclass(frozen=True)
class Graph:
    url: str
    sim_base: int

    def sim_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.sim_base + i}"


SIM_ENGINES = [
    {"name": "sim-prefill-0", "role": "prefill"},
    {"name": "sim-decode-0", "role": "decode"},
    {"name": "sim-unified-0", "role": "unified"},
]


@pytest.fixture(scope="session")
def graph() -> Iterator[Graph]:
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    sim_base = free_port_run(len(SIM_ENGINES))
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(
        {
            "model": MODEL,
            "admission": {"mode": "open", "queue_limit": 64, "max_wait_s": 30,
                          "phase_concurrency": {"prefill": 64, "decode": 256}},
            "sim": {"base_port": sim_base, "engines": SIM_ENGINES},
            "monitoring": {"scrape_interval_s": 0.5, "stale_after_s": 5.0},
        }
    )
    serve.run(app, name="narwhal", route_prefix="/")
    try:
        yield Graph(f"http://127.0.0.1:{port}", sim_base)
    finally:
        serve.shutdown()
        ray.shutdown()
