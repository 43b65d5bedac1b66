"""The Ray environment every in-process Serve session needs here; apply before importing ray."""

from __future__ import annotations

import os

ADMIN_TOKEN = "test-admin-token"
RAY_TEST_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    "NARWHAL_ADMIN_TOKEN": ADMIN_TOKEN,
}


def apply() -> None:
    for k, v in RAY_TEST_ENV.items():
        os.environ.setdefault(k, v)
