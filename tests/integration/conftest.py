"""One Ray Serve graph for the whole integration session (started in-process with serve.run)."""

from __future__ import annotations

from tests.support import ray_env

ray_env.apply()

import hashlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from tests.support.graph import ADMIN, MODEL  # noqa: E402
from tests.support.net import free_port_run  # noqa: E402
from tests.support.serve_session import serve_session  # noqa: E402

__all__ = ["ADMIN", "MODEL"]  # (re-exported: the integration tests import them from here)


TIGHT_KEY = "k-tight"
KEEPALIVE_S = 0.5  # the tight app's SSE keep-alive interval
BODY_TIMEOUT_S = 1.0  # the tight app's body read limit


@dataclass(frozen=True)
class Graph:
    url: str  # the main app: predictive admission, P/D + unified simulated fleet
    sim_base: int
    tight_url: str  # a second app: open admission, tiny limits, API keys, one unified engine
    tight_sim_url: str

    def sim_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.sim_base + i}"

    def unified_engine(self) -> dict[str, str]:
        return {"name": "sim-unified-0", "url": self.sim_url(2), "role": "unified", "dialect": "vllm"}


SIM_ENGINES = [
    {"name": "sim-prefill-0", "role": "prefill"},
    {"name": "sim-decode-0", "role": "decode"},
    {"name": "sim-unified-0", "role": "unified"},
]


@pytest.fixture(scope="session")
def graph() -> Iterator[Graph]:
    from ray import serve

    from deployments.app import build_app

    with serve_session() as port:
        sim_base = free_port_run(len(SIM_ENGINES))
        app = build_app(
            {
                "model": MODEL,
                "admission": {"mode": "predictive", "queue_limit": 64, "max_wait_s": 30,
                              "phase_concurrency": {"prefill": 64, "decode": 256}},
                "sim": {"base_port": sim_base, "engines": SIM_ENGINES},
                # The assembly and admission rows inject per-request faults back to back; breakers
                # (tested in tests/fault) would take engines out between tests here.
                "monitoring": {"scrape_interval_s": 0.5, "stale_after_s": 5.0, "breaker_failures": 1000},
                # nor drift (tested in test_overload_graph.py): injected slow first tokens are not a slow engine;
                # the engines' KV events are followed by two shard deployments (test_kv_shards_graph.py)
                "placement": {"drift_out_at": 1000.0, "kv_event_shards": 2},
                "deployment": {"ingress_max_replicas": 1, "assembler_max_replicas": 1},
                # tenants (tested in test_tenants_graph.py): requests without a key are the public
                # tier, with a budget far above any test's load (its lease shares are exercised
                # by every test); the openai client tests' key is a tenant of its own
                "tenants": {"anonymous": "public", "list": [
                    {"name": "public", "requests_per_minute": 1_000_000, "input_tokens_per_minute": 1_000_000_000},
                    {"name": "sdk", "key_sha256": [hashlib.sha256(b"unused").hexdigest()]},
                ]},
            }
        )
        tight_sim = free_port_run(1, start=sim_base + 10)
        tight = build_app(
            {
                "model": MODEL,
                "serving": {"max_request_bytes": 4096, "http_retention_limit": 3, "api_keys": [TIGHT_KEY],
                            "stream_keepalive_s": KEEPALIVE_S, "body_timeout_s": BODY_TIMEOUT_S},
                "admission": {"mode": "open", "queue_limit": 1, "max_wait_s": 5.0,
                              "phase_concurrency": {"prefill": 1, "decode": 2}},
                "sim": {"base_port": tight_sim, "engines": [{"name": "tight-unified-0", "role": "unified"}]},
                "monitoring": {"scrape_interval_s": 0.2, "stale_after_s": 5.0},
                "deployment": {"ingress_max_replicas": 1, "assembler_max_replicas": 1},
            }
        )
        serve.run(app, name="narwhal", route_prefix="/")
        serve.run(tight, name="tight", route_prefix="/tight")
        yield Graph(f"http://127.0.0.1:{port}", sim_base, f"http://127.0.0.1:{port}/tight",
                    f"http://127.0.0.1:{tight_sim}")
