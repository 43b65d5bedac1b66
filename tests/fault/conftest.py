"""The fault suite's own Ray Serve session: four applications, each with engines of its own that
the tests start, stop, restart, kill and freeze.

* ``pair`` (/pair): two unified in-process engines, so a failed attempt has somewhere to go;
  short first-token and idle limits, a quick circuit breaker.
* ``pd`` (/pd): one vLLM prefill/decode pair, in-process: a failing leg has no other route.
* ``tight`` (/tight): one fast unified engine, one prefill permit, a short body timeout and small
  slow-reader limits: the client-side faults.
* ``solo`` (/solo): one engine in a child process (SIGKILL, SIGSTOP) — also the application whose
  scheduler and assembler replicas are killed (it relays through the Assembler deployment,
  ``deployment.relay: assembler``; the other three relay in the ingress, the default).

Run on its own (``pytest tests/fault``): one Ray session per pytest process.
"""

from __future__ import annotations

from tests.support import ray_env

ray_env.apply()

from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from narwhal_serve.config.sim import SimEngineConfig  # noqa: E402
from tests.support.engine_host import EngineHost, EngineProcess  # noqa: E402
from tests.support.graph import MODEL  # noqa: E402
from tests.support.net import free_port  # noqa: E402
from tests.support.serve_session import serve_session  # noqa: E402

SCENARIO_TIMEOUT_S = 60  # per scenario, setup excluded: nothing may hang the suite

KEEPALIVE_S = 0.5
FIRST_TOKEN_TIMEOUT_S = 1.0  # pair, pd and solo
IDLE_TIMEOUT_S = 4.0  # pair, pd and solo: an engine silent this long fails the attempt
BODY_TIMEOUT_S = 1.0  # tight
STREAM_BUFFER_BYTES = 65536  # tight
SLOW_READER_TIMEOUT_S = 2.0  # tight
BACKPRESSURE_S = 1.0
BREAKER_OPEN_S = 0.5
BREAKER_MAX_OPEN_S = 2.0

STALE_AFTER_S = 1.5
MONITORING: dict[str, Any] = {"scrape_interval_s": 0.2, "stale_after_s": STALE_AFTER_S, "scrape_timeout_s": 0.5}
BREAKER: dict[str, Any] = {"breaker_failures": 2, "breaker_open_s": BREAKER_OPEN_S,
                           "breaker_max_open_s": BREAKER_MAX_OPEN_S, "backpressure_s": BACKPRESSURE_S}
ENGINE_LIMITS: dict[str, Any] = {"stream_keepalive_s": KEEPALIVE_S, "engine_idle_timeout_s": IDLE_TIMEOUT_S,
                                 "first_token_timeout_s": FIRST_TOKEN_TIMEOUT_S, "request_timeout_s": 60}
OPEN = {"mode": "open", "queue_limit": 64, "max_wait_s": 10, "phase_concurrency": {"prefill": 64, "decode": 256}}
ONE_REPLICA = {"ingress_max_replicas": 1, "assembler_max_replicas": 1}
# solo relays through the Assembler deployment (the others in the ingress): its replica can be killed
SOLO = {"deployment": {**ONE_REPLICA, "relay": "assembler"}}


@dataclass(frozen=True)
class App:
    """One deployed application and its engines (name → URL)."""

    name: str
    url: str
    engines: dict[str, str]
    roles: dict[str, str] = field(default_factory=dict)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.split("//")[1].split("/")[0].split(":")
        return host, int(port)

    @property
    def prefix(self) -> str:
        return "/" + self.url.split("//")[1].split("/", 1)[1]

    def engine(self, name: str) -> dict[str, str]:
        """``name``'s EngineConfig as registered (for the admin API)."""
        return {"name": name, "url": self.engines[name], "role": self.roles.get(name, "unified"), "dialect": "vllm"}


@dataclass
class Fleet:
    port: int
    host: EngineHost
    proc: EngineProcess
    pair: App
    pd: App
    tight: App
    solo: App


def _sim(name: str, role: str = "unified", **kw: Any) -> SimEngineConfig:
    return SimEngineConfig(name=name, role=role, model=MODEL, eos_prob=0, **kw)


def _app(name: str, prefix: str, port: int, engines: dict[str, str], roles: dict[str, str] | None = None) -> App:
    return App(name, f"http://127.0.0.1:{port}{prefix}", engines, roles or {})


def _args(app: App, **sections: Any) -> dict[str, Any]:
    engines = [app.engine(n) for n in app.engines]
    return {"model": MODEL, "engines": engines, "deployment": ONE_REPLICA, **sections}


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    from ray import serve

    from deployments.app import build_app

    host = EngineHost()
    proc = EngineProcess("solo-0", free_port(), "--eos-prob", "0", "--model", MODEL, "--tpot-base-s", "0.002")
    try:
        proc.start()
        pair = {n: host.start(_sim(n)) for n in ("pair-0", "pair-1")}
        pd = {"pd-prefill": host.start(_sim("pd-prefill", "prefill")),
              "pd-decode": host.start(_sim("pd-decode", "decode"))}
        # fast and long-winded: a client that stops reading is overtaken at once
        tight = {"tight-0": host.start(_sim("tight-0", max_model_len=65536, tpot_base_s=0.0002,
                                            tpot_per_running_s=0.0))}
        with serve_session() as port:
            apps = Fleet(
                port, host, proc,
                pair=_app("pair", "/pair", port, pair),
                pd=_app("pd", "/pd", port, pd, {"pd-prefill": "prefill", "pd-decode": "decode"}),
                tight=_app("tight", "/tight", port, tight),
                solo=_app("solo", "/solo", port, {"solo-0": proc.url}),
            )
            limits = {"serving": ENGINE_LIMITS, "monitoring": {**MONITORING, **BREAKER}, "admission": OPEN}
            tight_args = _args(
                apps.tight,
                serving={"stream_keepalive_s": KEEPALIVE_S, "engine_idle_timeout_s": IDLE_TIMEOUT_S,
                         "body_timeout_s": BODY_TIMEOUT_S, "http_retention_limit": 8,
                         "stream_buffer_bytes": STREAM_BUFFER_BYTES, "slow_reader_timeout_s": SLOW_READER_TIMEOUT_S},
                admission={"mode": "open", "queue_limit": 2, "max_wait_s": 10,
                           "phase_concurrency": {"prefill": 1, "decode": 4}},
                monitoring=MONITORING,
            )
            serve.run_many([  # all four at once: their replicas start side by side
                serve.RunTarget(build_app(_args(a, **limits, **(SOLO if a is apps.solo else {}))), name=a.name,
                                route_prefix=a.prefix)
                for a in (apps.pair, apps.pd, apps.solo)
            ] + [serve.RunTarget(build_app(tight_args), name="tight", route_prefix="/tight")])
            yield apps
    finally:
        host.close()
        proc.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.timeout(SCENARIO_TIMEOUT_S, func_only=True))
