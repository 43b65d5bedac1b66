"""A SchedulerService without HTTP: three engines (unified, prefill, decode) marked healthy by
hand, and a virtual clock."""

from __future__ import annotations

from typing import Any

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.scheduler.service import SchedulerService


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def scheduler_service(admission: dict[str, Any], serving: dict[str, Any] | None = None,
                      **more: Any) -> tuple[SchedulerService, Clock]:
    """``more``: other config sections (``tenants=...``)."""
    clock = Clock()
    cfg = NarwhalConfig.model_validate({
        **more,
        "serving": serving or {},
        "admission": admission,
        "engines": [{"name": "u", "url": "http://127.0.0.1:1", "role": "unified"},
                    {"name": "p", "url": "http://127.0.0.1:2", "role": "prefill"},
                    {"name": "d", "url": "http://127.0.0.1:3", "role": "decode"}],
    })
    svc = SchedulerService(cfg, clock=clock)
    for e in svc.engines.values():
        e.healthy, e.last_ok = True, clock.t
    svc.router.started = True
    return svc, clock
