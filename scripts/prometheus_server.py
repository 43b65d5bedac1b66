"""A real Prometheus for the dashboard test (``deploy/grafana/narwhal.json``) and for a local look.

    python scripts/prometheus_server.py install        # find `prometheus`, or install Debian's package
    python scripts/prometheus_server.py which          # print the binary's path (exit 1 when none)
    python scripts/prometheus_server.py run --target 127.0.0.1:8000 [--port 9090] [--interval 1s]

``install`` uses a ``prometheus`` already on PATH (or ``NARWHAL_PROMETHEUS``); otherwise, as root on
Debian/Ubuntu, ``apt-get install --no-install-recommends prometheus`` (Debian 12: 2.42), with a
``policy-rc.d`` that keeps the packaged service from starting (no system-wide listener on :9090).
``run`` and :class:`PrometheusServer` start a private instance: 127.0.0.1 only, a free port unless
given, its own configuration and TSDB in a temporary directory, stopped by its PID and removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from narwhal_serve.ports import free_port  # outside the ephemeral range, never handed out twice

DEBIAN_BINARY = "/usr/bin/prometheus"
POLICY_RC = Path("/usr/sbin/policy-rc.d")
APT_LOCK_WAIT = ["-o", "DPkg::Lock::Timeout=600"]  # others may be running apt on a shared machine


def find_binary() -> str | None:
    """``NARWHAL_PROMETHEUS``, else ``prometheus`` on PATH, else Debian's path; None when absent."""
    env = os.environ.get("NARWHAL_PROMETHEUS")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("prometheus")
    if found:
        return found
    return DEBIAN_BINARY if os.access(DEBIAN_BINARY, os.X_OK) else None


def version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "unknown version"


def _apt(args: list[str]) -> int:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print("+ apt-get " + " ".join(args), flush=True)
    return subprocess.run(["apt-get", *APT_LOCK_WAIT, *args], env=env, timeout=1200).returncode


def install() -> str:
    """The path of a usable ``prometheus``, installing Debian's package when there is none."""
    found = find_binary()
    if found:
        print(f"prometheus: {found} ({version(found)})")
        return found
    if not shutil.which("apt-get"):
        raise SystemExit("prometheus is not installed and there is no apt-get: install Prometheus 2.x and put "
                         "it on PATH (or set NARWHAL_PROMETHEUS)")
    if os.geteuid() != 0:
        raise SystemExit("prometheus is not installed: run this as root (CI is), or "
                         "`sudo apt-get install --no-install-recommends prometheus`")
    # Keep the packaged service from starting (it would listen on *:9090 system-wide); Docker
    # images already carry such a policy, which is then left as it is.
    created = False
    if not POLICY_RC.exists():
        POLICY_RC.write_text("#!/bin/sh\n# scripts/prometheus_server.py: no service starts during install\nexit 101\n")
        POLICY_RC.chmod(0o755)
        created = True
    try:
        install_cmd = ["install", "-y", "--no-install-recommends", "prometheus"]
        if _apt(install_cmd) != 0:  # package lists missing or stale: refresh once, then retry
            if _apt(["update"]) != 0 or _apt(install_cmd) != 0:
                raise SystemExit("apt-get could not install prometheus")
    finally:
        if created:
            POLICY_RC.unlink(missing_ok=True)
    found = find_binary()
    if not found:
        raise SystemExit("the prometheus package installed, but no prometheus binary was found")
    print(f"prometheus: {found} ({version(found)})")
    return found


def scrape_config(targets: list[str], job: str, interval: str, metrics_path: str = "/metrics") -> str:
    """prometheus.yml (JSON is YAML) for one job."""
    cfg = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": job, "metrics_path": metrics_path, "static_configs": [{"targets": targets}]}
        ],
    }
    return json.dumps(cfg, indent=2) + "\n"


class PrometheusServer:
    """One private Prometheus process scraping ``targets`` ("host:port")."""

    def __init__(
        self,
        targets: list[str],
        *,
        job: str = "narwhal",
        interval: str = "500ms",
        port: int | None = None,
        binary: str | None = None,
    ) -> None:
        self.binary = binary or find_binary()
        if self.binary is None:
            raise FileNotFoundError("no prometheus binary (run `python scripts/prometheus_server.py install`)")
        self.targets, self.job, self.interval = targets, job, interval
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="narwhal-prometheus-"))
        self.proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> "PrometheusServer":
        cfg = self.dir / "prometheus.yml"
        cfg.write_text(scrape_config(self.targets, self.job, self.interval))
        log = open(self.dir / "prometheus.log", "wb")
        assert self.binary is not None
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1d",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.dir,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"prometheus not ready within {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop our process by its PID (SIGTERM, then SIGKILL) and remove its files."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.dir / "prometheus.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # -- HTTP API -------------------------------------------------------------------------------
    def api(self, path: str, params: dict[str, str] | list[tuple[str, str]]) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 400/422: a bad query; the body says why
            body = json.loads(exc.read() or b"{}")
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}") from None
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """An instant query: ``{"resultType": ..., "result": [...]}``."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        out: dict[str, Any] = self.api("query", params)
        return out

    def label_values(self, label: str, match: str) -> list[str]:
        out: list[str] = self.api(f"label/{urllib.parse.quote(label)}/values", [("match[]", match)])
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="find prometheus, or install Debian's package")
    sub.add_parser("which", help="print the prometheus binary's path")
    run = sub.add_parser("run", help="a private Prometheus scraping a running Narwhal, until Ctrl-C")
    run.add_argument("--target", default="127.0.0.1:8000", help="Narwhal's host:port (its /metrics)")
    run.add_argument("--port", type=int, default=9090, help="Prometheus's port on 127.0.0.1")
    run.add_argument("--interval", default="1s", help="scrape interval")
    args = ap.parse_args(argv)
    if args.cmd == "install":
        install()
        return 0
    if args.cmd == "which":
        found = find_binary()
        print(found or "prometheus not found")
        return 0 if found else 1
    srv = PrometheusServer([args.target], interval=args.interval, port=args.port)
    srv.start()
    print(f"Prometheus on {srv.url}, scraping http://{args.target}/metrics every {args.interval} (Ctrl-C stops)")
    try:
        assert srv.proc is not None
        srv.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
