"""Sample Ray Serve's own view of a running Serve instance: per application and deployment, the
deployment status and how many replicas are in each state (``serve.status()``), one JSON line per
sample.

    python scripts/serve_replicas.py --address 127.0.0.1:GCS_PORT [--app narwhal] [--interval-s 1]
                                     [--out samples.jsonl] [--duration-s N]

``--address`` is the GCS address of the Ray instance that ``serve run`` started (``narwhal-bench
ramp`` starts it with ``RAY_GCS_SERVER_PORT`` set, so it knows the port). This script connects to it
as a second driver, reads, and disconnects on SIGINT/SIGTERM or after ``--duration-s``: it never
stops Ray or Serve. It lives outside ``narwhal_serve/`` because it imports Ray (the product never
does). Each line::

    {"t": <unix time>, "apps": {"narwhal": {"status": "RUNNING", "deployments":
        {"Ingress": {"status": "HEALTHY", "replicas": {"RUNNING": 2, "STARTING": 1}}, ...}}}}

A sample that fails (controller busy, a transient RPC error) is written as ``{"t": …, "error": …}``
and sampling goes on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any, TextIO

from narwhal_serve.runenv import RAY_BASE_ENV

RAY_DRIVER_ENV = RAY_BASE_ENV


def snapshot(status: Any, app: str | None = None) -> dict[str, Any]:
    """``serve.status()`` as plain JSON: ``{app: {"status", "deployments": {name: {"status",
    "replicas": {state: n}}}}}`` (only ``app`` when given)."""
    apps: dict[str, Any] = {}
    for name, a in status.applications.items():
        if app is not None and name != app:
            continue
        apps[name] = {
            "status": str(getattr(a.status, "value", a.status)),
            "deployments": {
                dname: {
                    "status": str(getattr(d.status, "value", d.status)),
                    "replicas": {str(getattr(s, "value", s)): int(n) for s, n in d.replica_states.items() if n},
                }
                for dname, d in a.deployments.items()
            },
        }
    return apps


def running(apps: dict[str, Any], app: str, deployment: str) -> int:
    """RUNNING replicas of ``app``/``deployment`` in a :func:`snapshot` (0 when absent)."""
    dep = apps.get(app, {}).get("deployments", {}).get(deployment, {})
    return int(dep.get("replicas", {}).get("RUNNING", 0))


def sample_loop(address: str, app: str | None, interval_s: float, out: TextIO, duration_s: float | None) -> None:
    for k, v in RAY_DRIVER_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.pop("RAY_ADDRESS", None)  # the explicit address below, never another instance
    import ray
    from ray import serve

    stop = False

    def _stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    ray.init(address=address, _node_ip_address="127.0.0.1", log_to_driver=False, logging_level=logging.WARNING,
             configure_logging=False)
    try:
        t_end = None if duration_s is None else time.monotonic() + duration_s
        next_at = time.monotonic()
        while not stop and (t_end is None or time.monotonic() < t_end):
            t = time.time()
            try:
                line: dict[str, Any] = {"t": t, "apps": snapshot(serve.status(), app)}
            except Exception as exc:  # noqa: BLE001 (a failed sample is recorded, not fatal)
                line = {"t": t, "error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(line) + "\n")
            out.flush()
            next_at += interval_s
            while not stop and time.monotonic() < next_at:
                time.sleep(min(0.05, max(0.0, next_at - time.monotonic())))
    finally:
        ray.shutdown()  # disconnects this driver; the instance and Serve keep running


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="GCS address of the Ray instance, HOST:PORT")
    p.add_argument("--app", help="only this application")
    p.add_argument("--interval-s", type=float, default=1.0)
    p.add_argument("--duration-s", type=float)
    p.add_argument("--out", help="JSONL file (default stdout)")
    ns = p.parse_args(argv)
    if ns.out:
        with open(ns.out, "a", encoding="utf-8") as fh:
            sample_loop(ns.address, ns.app, ns.interval_s, fh, ns.duration_s)
    else:
        sample_loop(ns.address, ns.app, ns.interval_s, sys.stdout, ns.duration_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
