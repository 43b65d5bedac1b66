"""Small helpers for driving the Ray graph (shared with tests/fault from tests/support/graph.py)."""

from __future__ import annotations

from tests.integration.conftest import TIGHT_KEY
from tests.support.graph import (
    Held,
    balanced,
    chat_body,
    counter,
    status,
    wait_engine_idle,
    wait_ready,
    wait_status,
    without_engine,
)

AUTH = {"Authorization": f"Bearer {TIGHT_KEY}"}

__all__ = ["AUTH", "Held", "balanced", "chat_body", "counter", "status", "wait_engine_idle", "wait_ready",
           "wait_status", "without_engine"]
