"""Router state: active, or one of the unavailable states the contract names (docs/contract.md, "Routes": the /ready reasons)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


RouterMode = Literal["active", "standby", "fenced", "monitoring_degraded"]


@dataclass
class RouterState:
    mode: RouterMode = "active"
    maintenance: set[str] = field(default_factory=set)  # waves under maintenance
    started: bool = False  # the first monitoring pass has run
    # draining (POST /admin/drain, the run command's SIGTERM): wall time past which the streams
    # still open are ended with an error event; None: not draining.  It never ends: a drained
    # router stops.
    drain_until: float | None = None

    def unavailable_reason(self, all_waves: set[str]) -> str | None:
        """The reason this router refuses everything now, or None when it serves."""
        if self.drain_until is not None:
            return "draining"
        if self.mode != "active":
            return self.mode
        if all_waves and all_waves <= self.maintenance:
            return "maintenance"  # whole-wave maintenance: every engine's wave is down
        return None
