"""The SIGTERM drain waits until an application has held no request for a while, not for one empty
/status: an ingress replica reports an admission it made just before the drain a little later (a
quiet one within its renewal period), and a drain that ended at the first empty answer let the
shutdown cut that request (from a review)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from narwhal_serve import drain as drain_mod
from narwhal_serve.config import ServingConfig
from narwhal_serve.drain import DrainTarget, drain


def test_a_request_reported_after_the_first_empty_status_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain_mod, "DRAIN_POLL_S", 0.01)
    monkeypatch.setattr(drain_mod, "DRAIN_QUIET_S", 0.1)
    # /status answers: empty, then the late report's request held for a few polls, then empty for good
    held = iter([0, 1, 1, 1])
    polls: list[int] = []

    def call(url: str, token: str | None = None, body: dict[str, object] | None = None) -> tuple[int, Any]:
        if url.endswith("/admin/drain"):
            return 200, {"draining": True}
        n = next(held, 0)
        polls.append(n)
        return 200, {"gauges": {"retained": n, "queued": 0}}

    monkeypatch.setattr(drain_mod, "_call", call)
    drain([DrainTarget("http://127.0.0.1:1", "TOKEN", ServingConfig())], {}, threading.Event(), log=lambda m: None)
    assert polls[:4] == [0, 1, 1, 1]  # (it ended at the first 0 before: polls == [0])
    assert polls[-1] == 0 and len(polls) >= 6
