"""The Ray environment every in-process Serve session needs here; apply before importing ray.

The run mode is Serve's direct ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``, overridable: ``make test``
also runs the integration suite with ``0``, behind Serve's proxy actor), with Narwhal's HAProxy
wrapper (:mod:`narwhal_serve.runenv`). HAProxy defaults to fixed ports (8404 stats, 9101 metrics,
8500 fallback proxy), so two sessions on one machine (a test run beside ``make run``) would
collide: each test process gets its own.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from narwhal_serve.config import ServingConfig
from narwhal_serve.runenv import RUN_ENV, IngressLimits, direct_ingress_env
from tests.support.net import free_port

ADMIN_TOKEN = "test-admin-token"
CLIENT_IDLE_S = 5
RAY_TEST_ENV = {
    **RUN_ENV,
    # Ray's own controller loop (0.1 s): a test session deploys and tears down applications again
    # and again, each step a few loop turns; the run mode's 0.5 s is measured by the benchmarks
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    "NARWHAL_ADMIN_TOKEN": ADMIN_TOKEN,
    "NARWHAL_HTTP_HEADER_TIMEOUT_S": "2",  # HAProxy's limit on slow request headers (default 10)
    # HAProxy's client timeout (a run derives it from its config: IngressLimits). Every wait on a
    # slow client in the suites is bounded by an app's limits of at most 2 s, so 5 s cuts nothing a
    # test expects the router to see, and a test can watch HAProxy close a connection in time.
    "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(CLIENT_IDLE_S),
}


def haproxy_env(d: str) -> dict[str, str]:
    """Private HAProxy ports and files (in ``d``) for one Serve session."""
    return {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(d, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(d, "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(d, "server-state"),
    }


def apply() -> None:
    # HAProxy's files and Narwhal's wrapper, removed when the test process ends (after Ray's own
    # exit handler: registered before Ray starts, it runs after it): each session left two folders
    d = tempfile.mkdtemp(prefix="narwhal-haproxy-")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    for k, v in {**RAY_TEST_ENV, **haproxy_env(d)}.items():
        os.environ.setdefault(k, v)
    if os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1":
        # the test applications' limits are no looser than the serving defaults
        os.environ.update(direct_ingress_env(dict(os.environ), IngressLimits.of([ServingConfig()]),
                                             os.path.join(d, "bin")))
