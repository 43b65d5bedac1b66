"""The benchmarks' run harness with a stand-in run: a small HTTP server that reads its port from
the config it is given, answers /ready, and takes a moment to stop on SIGINT (as `serve run`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from narwhal_serve.bench.harness import SERVE_RUN, Stop, narwhal_run, terminate_as_interrupt
from narwhal_serve.ports import free_port

RUN = r'''
import http.server, json, signal, sys, time
port = json.load(open(sys.argv[1]))["port"]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
def stop(*_):
    time.sleep(0.3)  # a clean shutdown takes a moment
    open(sys.argv[1] + ".stopped", "w").write(str(_[0]))
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
srv.serve_forever()
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def fake(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_run.py"
    script.write_text(RUN)
    return [sys.executable, str(script)]


def test_the_run_is_ready_inside_and_stopped_cleanly_after(fake: list[str], tmp_path: Path) -> None:
    port = free_port()
    with narwhal_run(fake, {"port": port}, port, tmp_path / "logs", env=dict(os.environ), cwd=tmp_path,
                     start_timeout_s=20, stop=SERVE_RUN) as run:
        assert run.base == f"http://127.0.0.1:{port}" and run.startup_s >= 0
        assert run.cfg_path.is_file() and run.proc.alive()
        pid = run.proc.pid
    assert not _alive(pid)
    # the first signal was SIGINT, and the run had the time to stop on it
    assert (tmp_path / "logs" / "narwhal-serve-config.yaml.stopped").read_text() == str(int(signal.SIGINT))


def test_an_error_inside_still_stops_the_run(fake: list[str], tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(RuntimeError, match="boom"):
        with narwhal_run(fake, {"port": port}, port, tmp_path / "logs", env=dict(os.environ), cwd=tmp_path,
                         start_timeout_s=20, stop=Stop(signal.SIGINT, 5.0, 5.0)) as run:
            pid = run.proc.pid
            raise RuntimeError("boom")
    assert not _alive(pid)


def test_sigterm_inside_is_an_interrupt_and_the_run_is_stopped(fake: list[str], tmp_path: Path) -> None:
    port = free_port()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with terminate_as_interrupt(), narwhal_run(fake, {"port": port}, port, tmp_path / "logs", env=dict(os.environ),
                                                   cwd=tmp_path, start_timeout_s=20, stop=SERVE_RUN) as run:
            pid = run.proc.pid
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
            threading.Event().wait(10)  # interrupted long before
    assert not _alive(pid)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_run_that_never_gets_ready_is_stopped_and_named(fake: list[str], tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with narwhal_run([sys.executable, "-c", "import time; time.sleep(60)"], {}, free_port(), tmp_path / "logs",
                         env=dict(os.environ), cwd=tmp_path, start_timeout_s=1.0, stop=Stop(signal.SIGTERM, 2.0, 2.0)):
            pytest.fail("not ready: never inside")
