"""`scripts/serve_run.py` in HA-proxy mode: SIGTERM (systemd, Kubernetes) and SIGINT (Ctrl-C) both stop
the whole run cleanly -- exit 0, nothing of the run left running, no port of the run still bound.

Starts a real `serve run` (its own Ray session) on a copy of serve_config.yaml with free ports, and gives
it its own HAProxy stats / metrics / fallback-proxy ports and HAProxy file folder, so it can run while
other Ray sessions (in-process integration tests, `make run`) use the defaults.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from scripts import serve_run
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 90.0

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.timeout(300),
]


@dataclass
class Run:
    proc: subprocess.Popen[bytes]
    run_id: str
    haproxy_dir: str
    log_path: Path
    port: int
    fixed_ports: dict[str, int]
    session: dict[int, str] = field(default_factory=dict)  # pid -> /proc stat start time, before the stop

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _start_time(pid: int) -> str | None:
    f = serve_run.stat_fields(pid)
    return None if f is None else f[19]  # field 22 of /proc/<pid>/stat: start time


def _http(url: str, body: dict[str, object] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


@pytest.fixture
def run(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Run]:
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    engines = cfg["applications"][0]["args"]["engines"]
    assert engines and all(e["launch"]["kind"] == "sim" for e in engines)  # make run's managed simulated fleet
    slow = request.node.get_closest_marker("slow_engines")
    if slow is not None:  # at 20 ms a token, no early end: answers that take seconds
        for e in engines:
            e["launch"]["args"] = ["--tpot-base-s", "0.02", "--tpot-per-running-s", "0", "--eos-prob", "0"]
    port = free_port()
    cfg["http_options"]["port"] = port
    cfg_path = tmp_path / "serve_config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    # the engines' own ports are free ones their replicas pick: found among the run's listeners
    fixed = {"router": port}
    for name in ("haproxy_stats", "haproxy_metrics", "fallback_proxy"):
        fixed[name] = free_port()
    # Short: Ray appends /<56-char node id>/ and unix socket paths are limited to 107 bytes.
    hap = tempfile.mkdtemp(prefix="nwt-", dir="/tmp")
    run_id = uuid.uuid4().hex
    # Nothing Ray- or Narwhal-specific from this process (an in-process session may have set some).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "NARWHAL_"))}
    env.update(
        {
            serve_run.RUN_ID_ENV: run_id,
            "RAY_SERVE_ENABLE_HA_PROXY": "1",  # the mode whose HAProxy outlived a SIGTERM
            "NARWHAL_STOP_TIMEOUT_S": "60",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(fixed["haproxy_stats"]),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(fixed["haproxy_metrics"]),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fixed["fallback_proxy"]),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{hap}/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{hap}/admin.sock",
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": hap,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{hap}/server-state",
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{hap}/metrics.sock",
        }
    )
    log_path = tmp_path / "serve_run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "scripts/serve_run.py", str(cfg_path)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C on the test run reaches only pytest
        )
    r = Run(proc, run_id, hap, log_path, port, fixed)
    try:
        yield r
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        serve_run.sweep(run_id, hap, None, settle_s=0)
        shutil.rmtree(hap, ignore_errors=True)


def _wait_serving(r: Run) -> None:
    base = f"http://127.0.0.1:{r.port}"
    chat = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    deadline = time.monotonic() + READY_TIMEOUT_S
    last: object = None
    while time.monotonic() < deadline:
        assert r.proc.poll() is None, f"serve_run exited early ({r.proc.returncode}):\n{r.log_tail()}"
        try:
            if _http(f"{base}/ready", timeout=5)[0] == 200:
                status, body = _http(f"{base}/v1/chat/completions", chat, timeout=20)
                if status == 200 and json.loads(body)["choices"]:
                    return
                last = (status, body[:200])
        except (OSError, ValueError) as e:
            last = e
        time.sleep(1.0)
    pytest.fail(f"not serving after {READY_TIMEOUT_S:.0f} s (last: {last!r}):\n{r.log_tail()}")


def _snapshot(r: Run) -> dict[int, set[tuple[str, int]]]:
    """The run's processes (kept in r.session) and every port they listen on."""
    pids = serve_run.run_processes(r.run_id, r.haproxy_dir)
    for pid in pids:
        st = _start_time(pid)
        if st is not None:
            r.session[pid] = st
    return {port: owners for port, owners in serve_run.listening().items() if any(p in r.session for _, p in owners)}


def _still_alive(r: Run) -> list[str]:
    left = []
    for pid, st in r.session.items():
        if serve_run.alive(pid) and _start_time(pid) == st:
            left.append(f"{pid} {' '.join(serve_run.cmdline(pid))[:100]}")
    return left


def _serving_snapshot(r: Run) -> set[int]:
    """Once the run serves: every port it uses, after checking that its HAProxy, its fixed ports and
    its three managed engines are all up."""
    _wait_serving(r)
    # HAProxy is replaced on every reload, the fallback proxy may bind after the app answers, and
    # the managed engines boot after their replicas (the app answers once one engine is up): look
    # again, bounded, until all of the run's fixed ports and its three engines' ports are bound.
    deadline = time.monotonic() + 60
    while True:
        ports = _snapshot(r)
        haproxy = [p for p in r.session if any(r.haproxy_dir in a for a in serve_run.cmdline(p))]
        unbound = {k: v for k, v in r.fixed_ports.items() if v not in ports}
        # the managed simulated engines are the run's too: three engine processes, each listening
        engines = [p for p in r.session if "narwhal_serve.sim.cli" in " ".join(serve_run.cmdline(p))]
        listening = [p for p in engines if any(o == p for owners in ports.values() for _, o in owners)]
        if (haproxy and not unbound and len(listening) == len(engines) == 3) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert haproxy, f"no HAProxy of this run found (HA-proxy mode off?):\n{r.log_tail()}"
    assert unbound == {}, f"not bound by the run: {unbound}\n{r.log_tail()}"
    assert len(engines) == 3 and listening == engines, (engines, listening, ports)
    return set(ports) | set(r.fixed_ports.values())


def _stopped_cleanly(r: Run, sig: signal.Signals, t0: float, used: set[int]) -> None:
    """After ``sig`` (sent at ``t0``): exit 0, nothing of the run left running, none of its ports
    still bound."""
    try:
        rc = r.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve_run still running {STOP_TIMEOUT_S:.0f} s after {sig.name}:\n{r.log_tail()}")
    stop_s = time.monotonic() - t0
    print(f"{sig.name}: exit {rc} after {stop_s:.1f} s; the run used ports {sorted(used)}")

    assert rc == 0, f"exit {rc} after {sig.name}:\n{r.log_tail()}"
    assert _still_alive(r) == [], r.log_tail()
    assert serve_run.run_processes(r.run_id, r.haproxy_dir) == []
    now = serve_run.listening()
    left = {p: now[p] for p in used if p in now and (p in r.fixed_ports.values() or any(o in r.session for _, o in now[p]))}
    assert left == {}, f"still listening after {sig.name}: {left}"


def test_sigint_stops_everything(run: Run) -> None:
    """Ctrl-C: the same clean stop as SIGTERM's (test_sigterm_drains_the_requests_in_flight)."""
    used = _serving_snapshot(run)
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGINT)
    _stopped_cleanly(run, signal.SIGINT, t0, used)


def _stream_chat(base: str, max_tokens: int, out: dict[str, object]) -> None:
    """One streaming chat through the run; ``out``: status, the data events, an exception."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(base)
    body = json.dumps({"model": "narwhal-sim", "messages": [{"role": "user", "content": "Tell me more"}],
                       "max_tokens": max_tokens, "stream": True})
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        events = []
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
        out["events"] = events
        conn.close()
    except Exception as exc:  # the test reports it
        out["error"] = repr(exc)


@pytest.mark.slow_engines
def test_sigterm_drains_the_requests_in_flight(run: Run) -> None:
    """A rolling restart: SIGTERM while streams and a non-streaming request are in flight. The
    router stops admitting (/ready 503, new requests 503 router_unavailable), every request in
    flight completes, each stream with its [DONE]; then the run stops as cleanly as after Ctrl-C (exit 0,
    nothing of the run left running, none of its ports bound)."""
    import threading

    used = _serving_snapshot(run)
    base = f"http://127.0.0.1:{run.port}"
    results: list[dict[str, object]] = [{} for _ in range(4)]
    threads = [threading.Thread(target=_stream_chat, args=(base, 150, results[i])) for i in range(3)]
    plain: dict[str, object] = {}

    def one_plain() -> None:
        chat = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100}
        plain["status"], plain["body"] = _http(f"{base}/v1/chat/completions", chat, timeout=60)

    threads.append(threading.Thread(target=one_plain))
    for t in threads:
        t.start()
    time.sleep(1.0)  # in flight (each takes a few seconds)
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while _http(f"{base}/ready", timeout=5)[0] != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    status, body = _http(f"{base}/ready", timeout=5)
    assert status == 503 and json.loads(body)["reason"] == "draining", run.log_tail()
    status, body = _http(f"{base}/v1/chat/completions",
                         {"model": "narwhal-sim", "messages": [{"role": "user", "content": "late"}], "max_tokens": 2})
    assert status == 503 and json.loads(body)["error"]["code"] == "router_unavailable"
    for t in threads:
        t.join(timeout=60)
    for r in results[:3]:
        assert r.get("status") == 200 and "error" not in r, (r, run.log_tail())
        events = r["events"]
        assert isinstance(events, list) and events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        assert sum(1 for e in events if '"content"' in e) >= 100  # the whole answer, not a cut
    assert plain.get("status") == 200, plain
    _stopped_cleanly(run, signal.SIGTERM, t0, used)
    assert "draining" in run.log_tail(200)
