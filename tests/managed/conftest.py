"""Managed engines on a multi-node Ray cluster, all on this one machine (``ray.cluster_utils``).

The cluster: a head node (2 CPUs, where Serve's proxy, controller and the router run) and three
worker nodes, each with custom resources of its own: ``zone_a``, ``zone_b``, and ``gpu_node`` with
two (logical) GPUs.  One Narwhal app: managed simulated engines that ask for ``zone_a``, for
``zone_b``, and for both GPUs with tensor parallelism 2, and one URL engine (an in-process
simulated engine) beside them.

Run on its own (``pytest tests/managed``, as ``make test-managed`` does): Ray is initialised once
per process; when collected with other suites these tests are deselected with a note.

Several Ray "nodes" on one machine share its ports, so Serve runs with its proxy actor on the head
node only (``RAY_SERVE_ENABLE_HA_PROXY=0``, ``proxy_location: HeadOnly``), and the cluster writes
its address under a private ``RAY_TMPDIR``: otherwise a ``serve run`` started meanwhile on this
machine (another suite) would attach to this cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "narwhal-sim"
MANAGED_DIR = Path(__file__).resolve().parent
HEALTH_CHECK_PERIOD_S = 1.0  # Serve asks each engine replica this often; 3 failures → a new replica
SIM_ARGS = ["--tpot-base-s", "0.03", "--eos-prob", "0"]  # streams long enough to be cut mid-way
NOTES: list[str] = []


@dataclass(frozen=True)
class Fleet:
    url: str  # Narwhal
    nodes: dict[str, str]  # custom resource → node id (zone_a, zone_b, gpu_node, head)
    url_engine: str  # the URL engine's base URL

    def status(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/status", timeout=10)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def engines(self) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in self.status()["engines"]}


def _ours(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(MANAGED_DIR)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [i for i in items if _ours(i)]
    others = [i for i in items if not _ours(i)]
    if ours and others:
        config.hook.pytest_deselected(items=ours)
        items[:] = others
        NOTES.append(f"deselected {len(ours)} managed-engine tests: they run in their own session "
                     "(`pytest tests/managed`)")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if NOTES:
        terminalreporter.section("narwhal managed engines")
        for line in NOTES:
            terminalreporter.write_line(line)


def url_engine_process(port: int, log: Path) -> subprocess.Popen[bytes]:
    """The URL engine: a simulated engine this session runs itself (not managed by Ray)."""
    argv = [sys.executable, "-m", "narwhal_serve.sim.cli", "--host", "127.0.0.1", "--port", str(port),
            "--name", "url0", "--model", MODEL, *SIM_ARGS]
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def managed(name: str, resources: dict[str, Any], log_dir: str, **launch: Any) -> dict[str, Any]:
    return {"name": name, "role": "unified", "dialect": "vllm",
            "launch": {"kind": "sim", "args": SIM_ARGS, "resources": resources, "log_dir": log_dir,
                       "health_check_period_s": HEALTH_CHECK_PERIOD_S, "stop_grace_s": 2, **launch}}


def wait_for(pred: Any, timeout_s: float, what: str, every_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except httpx.HTTPError as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:g} s (last: {last!r})")


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    tmp = tempfile.mkdtemp(prefix="nwm-", dir="/tmp")  # short: unix socket paths live under it
    os.environ["RAY_TMPDIR"] = tmp
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    from tests.support import ray_env

    ray_env.apply()

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app
    from tests.support.net import free_port

    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    url_port = free_port()
    url_proc = url_engine_process(url_port, Path(tmp) / "url0.log")
    url_engine = f"http://127.0.0.1:{url_port}"
    try:
        workers = {"zone_a": {"num_cpus": 1}, "zone_b": {"num_cpus": 1}, "gpu_node": {"num_cpus": 1, "num_gpus": 2}}
        for res, kw in workers.items():
            cluster.add_node(resources={res: 1}, **kw)
        ray.init(address=cluster.address, log_to_driver=False)
        nodes = {"head": next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])}
        for n in ray.nodes():
            for res in workers:
                if res in n["Resources"]:
                    nodes[res] = n["NodeID"]
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        wait_for(lambda: httpx.get(url_engine + "/health", timeout=2).status_code == 200, 60, "the URL engine")
        logs = os.path.join(tmp, "engines")
        app = build_app({
            "model": MODEL,
            "admission": {"mode": "open", "queue_limit": 64, "max_wait_s": 30},
            "serving": {"first_token_timeout_s": 5.0},
            "monitoring": {"scrape_interval_s": 0.5, "stale_after_s": 3.0, "breaker_open_s": 0.5,
                           "breaker_max_open_s": 2.0},
            "deployment": {"ingress_max_replicas": 1, "assembler_max_replicas": 1},
            "engines": [
                managed("za", {"num_cpus": 0.5, "custom": {"zone_a": 1}}, logs),
                managed("zb", {"num_cpus": 0.5, "custom": {"zone_b": 1}}, logs),
                managed("tp", {"num_cpus": 0.5, "num_gpus": 2, "custom": {"gpu_node": 1}}, logs,
                        tensor_parallel_size=2),
                {"name": "url0", "url": url_engine, "role": "unified", "dialect": "vllm"},
            ],
        })
        serve.run(app, name="narwhal", route_prefix="/")
        f = Fleet(f"http://127.0.0.1:{port}", nodes, url_engine)
        wait_for(lambda: all(e["eligible"] for e in f.engines().values()), 60, "every engine eligible")
        NOTES.append(f"cluster (4 nodes) + Serve + 3 managed engines up in {time.monotonic() - t0:.1f} s")
        yield f
    finally:
        with_errors: list[str] = []
        def stop_url_engine() -> None:
            os.killpg(url_proc.pid, signal.SIGTERM)
            url_proc.wait(timeout=10)

        for stop in (serve.shutdown, ray.shutdown, cluster.shutdown, stop_url_engine):
            try:
                stop()
            except Exception as exc:  # keep going: every later step still has to run
                with_errors.append(repr(exc))
        shutil.rmtree(tmp, ignore_errors=True)
        assert not with_errors, with_errors
