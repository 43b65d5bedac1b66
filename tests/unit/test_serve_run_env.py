"""`scripts/serve_run.py` build_env: the HAProxy wrapper a run writes lies in the folder the run
removes when it ends.  With the caller's own HAProxy paths in the environment (the test harness
sets them), the wrapper was written to a temp folder of its own that nothing removed: a CI run left
about six ``narwhal-haproxy-bin-*`` folders in /tmp.  The test failed before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

from narwhal_serve.config import ServingConfig
from narwhal_serve.runenv import IngressLimits, real_haproxy
from scripts import serve_run

LIMITS = IngressLimits.of([ServingConfig()])


def test_the_wrapper_lies_in_the_folder_the_run_removes(tmp_path: Path) -> None:
    if real_haproxy() is None:
        import pytest

        pytest.skip("no HAProxy binary here")
    own = {k: str(tmp_path / (leaf or "state")) for k, leaf in serve_run.HAPROXY_PATH_VARS.items()}
    for base in ({}, own):
        env, folder = serve_run.build_env({**base, "RAY_SERVE_ENABLE_HA_PROXY": "1"}, LIMITS)
        try:
            assert folder is not None, base
            wrapper = Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"])
            assert wrapper.is_file() and wrapper.is_relative_to(folder), (wrapper, folder)
            for k, v in base.items():  # the caller's paths kept
                assert env[k] == v
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
    # an HAProxy binary of the caller's own: no wrapper, no folder for it
    env, folder = serve_run.build_env({**own, "RAY_SERVE_ENABLE_HA_PROXY": "1",
                                       "RAY_SERVE_HAPROXY_BINARY_PATH": "/usr/sbin/haproxy"}, LIMITS)
    assert folder is None and env["RAY_SERVE_HAPROXY_BINARY_PATH"] == "/usr/sbin/haproxy"
