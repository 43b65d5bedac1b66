"""End-to-end session: one real vLLM-CPU server and Narwhal's real Ray Serve graph in front of it.

Run on its own (``pytest tests/e2e``): Ray can be initialised once per process, so this suite never
shares a session with ``tests/integration``; when both are collected together the e2e tests are
deselected with a message (run them as a separate invocation, as CI does).

The vLLM venv and the tiny model are built on first use (cached under ``.cache/``; CI starts fresh).
A failure to install, build or start the engine is an error, never a skip — unless
``NARWHAL_SKIP_E2E=1`` is set.

For quick iterations, reuse servers started with ``scripts/vllm_cpu_engine.py start`` instead:
``NARWHAL_E2E_VLLM_URL=http://127.0.0.1:P`` (unified) and ``NARWHAL_E2E_PD_URLS=PREFILL_URL,DECODE_URL``
(both started with ``--kv-shared`` on the same directory); they are left running.
"""

from __future__ import annotations

import os

from tests.support import ray_env  # noqa: E402

ray_env.apply()

import contextlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from scripts import vllm_cpu_engine as engine  # noqa: E402
from tests.support.net import free_port  # noqa: E402

MODEL = "tiny"
ENGINE_NAME = "vllm0"
ADMIN = {"Authorization": f"Bearer {ray_env.ADMIN_TOKEN}"}
E2E_DIR = Path(__file__).resolve().parent
SKIP = os.environ.get("NARWHAL_SKIP_E2E") == "1"

# Filled in by the fixtures and tests, printed at the end of the session.
REPORT: dict[str, Any] = {"timings": {}, "notes": []}


@dataclass(frozen=True)
class E2E:
    narwhal: str  # Narwhal's base URL (Ray Serve HTTP proxy)
    vllm: str  # the vLLM server's base URL (for direct comparison requests)
    server: engine.Server


def _in_e2e(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(E2E_DIR)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [i for i in items if _in_e2e(i)]
    if not ours:
        return
    others = [i for i in items if not _in_e2e(i)]
    if others:
        # Ray Serve starts once per process and tests/integration starts its own: run us separately.
        config.hook.pytest_deselected(items=ours)
        items[:] = others
        REPORT["notes"].append(
            f"deselected {len(ours)} e2e tests: they run in their own session (`pytest tests/e2e`)"
        )
        return
    if SKIP:
        mark = pytest.mark.skip(reason="NARWHAL_SKIP_E2E=1")
        for item in ours:
            item.add_marker(mark)
    # The P/D pair boots together with the unified engine (in parallel) when a selected test needs it.
    REPORT["want_pd"] = any("pd" in getattr(i, "fixturenames", ()) for i in ours)
    REPORT["want_kv"] = any("kv_engine" in getattr(i, "fixturenames", ()) for i in ours)
    REPORT["want_victim"] = any("resume_app" in getattr(i, "fixturenames", ()) for i in ours)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    timings = {**engine.TIMINGS, **REPORT["timings"]}
    if not timings and not REPORT["notes"] and "ttft" not in REPORT:
        return
    tr = terminalreporter
    tr.section("narwhal e2e")
    for note in REPORT["notes"]:
        tr.write_line(note)
    for name, secs in timings.items():
        tr.write_line(f"{name:<28} {secs:7.1f} s")
    if "ttft" in REPORT:
        tr.write_line(REPORT["ttft"])
    for line in REPORT.get("extra", []):
        tr.write_line(line)


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/ready", timeout=5)
            if r.status_code == 200:
                return
            last = r.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise RuntimeError(f"Narwhal not ready after {timeout_s} s: {last}")


@dataclass(frozen=True)
class Engines:
    unified: engine.Server
    prefill: engine.Server | None = None  # the P/D pair (ExampleConnector over a shared directory)
    decode: engine.Server | None = None
    kv_dir: Path | None = None
    kv_events: engine.Server | None = None  # publishes KV events (KV_EVENTS_*), with a small KV cache
    victim: engine.Server | None = None  # a second unified engine, killed mid-answer by the resume test


# The KV-events engine: vLLM binds ipc:// endpoints (it connects to tcp:// ones unless they name *),
# and a cache of KV_BLOCKS blocks of 128 tokens, small enough for a test to make it evict.
KV_BLOCKS = 24


def kv_endpoints(port: int) -> tuple[str, str]:
    base = f"ipc:///tmp/narwhal-e2e-kv-{port}"  # (a Unix socket path: kept short)
    return base, base + "-replay"


def remove_kv_sockets(port: int) -> None:
    """The socket files of a stopped KV-events engine (vLLM leaves them)."""
    from narwhal_serve.ports import ipc_paths

    for path in ipc_paths(kv_endpoints(port)):
        with contextlib.suppress(OSError):
            os.unlink(path)


def kv_engine_args(port: int) -> list[str]:
    pub, replay = kv_endpoints(port)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    import json

    return ["--kv-events-config", json.dumps(cfg), "--num-gpu-blocks-override", str(KV_BLOCKS)]


def _external(url: str) -> engine.Server:
    """A server this session did not start (never stopped by it)."""
    url = url.strip().rstrip("/")
    return engine.Server(int(url.rsplit(":", 1)[1]), 0, MODEL, Path("/dev/null"), Path("/dev/null"))


@pytest.fixture(scope="session")
def engines() -> Iterator[Engines]:
    """One unified vLLM server per session (+ a P/D pair when P/D tests are selected), booted together."""
    if SKIP:
        pytest.skip("NARWHAL_SKIP_E2E=1")
    ext_unified = os.environ.get("NARWHAL_E2E_VLLM_URL")
    ext_pd = os.environ.get("NARWHAL_E2E_PD_URLS")
    if ext_unified and (ext_pd or not REPORT.get("want_pd")):
        pd = [_external(u) for u in ext_pd.split(",")] if ext_pd else [None, None]
        yield Engines(_external(ext_unified), pd[0], pd[1])
        return
    engine.install()  # cached locally; raises (fails the suite) when it cannot be installed
    engine.build_model()
    launched: list[engine.Server] = []
    kv_dir: Path | None = None
    try:
        unified = engine.launch_server(free_port(), MODEL)
        launched.append(unified)
        prefill = decode = kv = victim = None
        if REPORT.get("want_victim"):
            victim = engine.launch_server(free_port(), MODEL)
            launched.append(victim)
        if REPORT.get("want_kv"):
            port = free_port()
            kv = engine.launch_server(port, MODEL, kv_engine_args(port))
            launched.append(kv)
        if REPORT.get("want_pd"):
            engine.CACHE.mkdir(parents=True, exist_ok=True)
            kv_dir = Path(tempfile.mkdtemp(prefix="kv-shared-", dir=engine.CACHE))
            prefill = engine.launch_server(free_port(), MODEL, engine.kv_connector_args(kv_dir))
            launched.append(prefill)
            decode = engine.launch_server(free_port(), MODEL, engine.kv_connector_args(kv_dir))
            launched.append(decode)
        for server in launched:
            engine.wait_server(server)
        roles = {"unified": unified, "prefill": prefill, "decode": decode, "kv-events": kv, "victim": victim}
        REPORT["notes"].append(
            "vLLM servers (booted in parallel): "
            + ", ".join(f"{role} on port {s.port}" for role, s in roles.items() if s is not None)
        )
        yield Engines(unified, prefill, decode, kv_dir, kv, victim)
    finally:
        for server in launched:
            engine.stop_server(server)
            remove_kv_sockets(server.port)
        if kv_dir is not None:
            shutil.rmtree(kv_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_server(engines: Engines) -> engine.Server:
    return engines.unified


@pytest.fixture(scope="session")
def kv_engine(engines: Engines) -> Iterator[engine.Server]:
    """The vLLM engine that publishes KV events (booted with the others; on its own when the session
    reuses external servers)."""
    if engines.kv_events is not None:
        yield engines.kv_events
        return
    engine.install()
    engine.build_model()
    port = free_port()
    server = engine.launch_server(port, MODEL, kv_engine_args(port))
    try:
        yield engine.wait_server(server)
    finally:
        engine.stop_server(server)
        remove_kv_sockets(port)


@pytest.fixture(scope="session")
def e2e(vllm_server: engine.Server) -> Iterator[E2E]:
    import ray
    from ray import serve

    from deployments.app import build_app

    t0 = time.monotonic()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(
            {
                "model": MODEL,
                "tokenizer": str(engine.MODEL_DIR),  # the engine's own: prompts sized by their exact token IDs
                # and sent to it as those IDs once it agreed, chats too (every answer here is checked
                # against the engine's own answer to the text)
                "serving": {"forward_prompt_ids": "all"},
                "admission": {"mode": "open"},
                "engines": [{"name": ENGINE_NAME, "url": vllm_server.url, "role": "unified", "dialect": "vllm"}],
            }
        )
        serve.run(app, name="narwhal-e2e", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url)
        REPORT["timings"]["narwhal-start (ray+serve)"] = time.monotonic() - t0
        t1 = time.monotonic()
        yield E2E(url, vllm_server.url, vllm_server)
        REPORT["timings"]["tests"] = time.monotonic() - t1
    finally:
        serve.shutdown()
        ray.shutdown()


@dataclass(frozen=True)
class ResumeApp:
    url: str  # the application's base URL
    victim: engine.Server  # placed first, killed mid-answer
    survivor: engine.Server


@pytest.fixture(scope="session")
def resume_app(e2e: E2E, engines: Engines) -> Iterator[ResumeApp]:
    """A second application in the e2e session, over two unified engines: the session's engine and a
    victim of its own (booted with the others, or here when the session reuses external servers)."""
    from ray import serve

    from deployments.app import build_app

    victim = engines.victim
    own = victim is None
    if victim is None:
        victim = engine.launch_server(free_port(), MODEL)
    try:
        engine.wait_server(victim)
        app = build_app({
            "model": MODEL,
            "tokenizer": str(engine.MODEL_DIR),
            "admission": {"mode": "open"},
            # one ingress: its lease places every request, least loaded first (the test relies on it)
            "deployment": {"ingress_max_replicas": 1, "assembler_max_replicas": 1},
            "engines": [{"name": "victim", "url": victim.url, "role": "unified", "dialect": "vllm"},
                        # its own wave: the test keeps new work off it with POST /admin/maintenance
                        {"name": ENGINE_NAME, "url": e2e.vllm, "role": "unified", "dialect": "vllm", "wave": "b"}],
        })
        serve.run(app, name="narwhal-resume", route_prefix="/resume")
        url = e2e.narwhal + "/resume"
        _wait_ready(url)
        yield ResumeApp(url, victim, e2e.server)
        serve.delete("narwhal-resume")
    finally:
        if own:
            engine.stop_server(victim)
