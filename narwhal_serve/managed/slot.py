"""What a managed-engine replica tells the scheduler (:class:`ReplicaReport`), and what the
scheduler keeps per managed engine (:class:`ManagedSlot`, shown under ``placement`` in /status)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from narwhal_serve.config.launch import slot_names

__all__ = ["HEARTBEAT_S", "STALE_AFTER_S", "ManagedSlot", "ReplicaReport", "slot_names"]

HEARTBEAT_S = 5.0  # a replica repeats its report this often (a restarted scheduler re-learns it)
STALE_AFTER_S = 3 * HEARTBEAT_S + 5.0  # a holder silent this long gives its slot up to a new replica


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's engine, up and answering /health."""

    engine: str  # the config entry's name
    replica: str  # Serve's replica id (unique per replica: a restart is a new one)
    url: str
    node_id: str
    node_ip: str
    accelerator_ids: tuple[str, ...]
    pid: int
    log: str  # the engine's log file, on its node
    ready_s: float  # spawn to /health answering
    kv_events: tuple[str, str] | None = None  # its KV-event PUB and replay sockets, as the router reaches them


State = Literal["starting", "up", "down"]


@dataclass
class ManagedSlot:
    """One engine process's place in the fleet: ``<name>`` (one replica) or ``<name>-<k>``."""

    engine: str
    index: int
    state: State = "starting"
    report: ReplicaReport | None = None
    since: float = 0.0  # when ``state`` last changed
    last_seen: float | None = None  # the holder's last report
    replicas_seen: int = 0  # replicas that have held this slot (restarts = this - 1)
    last_exit: str | None = None  # why the previous engine process ended

    @property
    def up(self) -> bool:
        return self.state == "up"

    def free_for(self, replica: str, now: float) -> bool:
        """A new replica may take this slot: nobody holds it, or its holder is down or silent."""
        if self.report is None or self.state != "up":
            return True
        return self.report.replica != replica and (self.last_seen is None or now - self.last_seen > STALE_AFTER_S)

    def view(self, now: float) -> dict[str, Any]:
        rep = self.report
        return {
            "engine": self.engine,
            "state": self.state,
            "for_s": round(now - self.since, 3),
            "node_id": rep.node_id if rep else None,
            "node_ip": rep.node_ip if rep else None,
            "accelerator_ids": list(rep.accelerator_ids) if rep else [],
            "replica": rep.replica if rep else None,
            "pid": rep.pid if rep else None,
            "log": rep.log if rep else None,
            "ready_s": round(rep.ready_s, 3) if rep else None,
            "heartbeat_age_s": None if self.last_seen is None else round(now - self.last_seen, 3),
            "restarts": max(0, self.replicas_seen - 1),
            "last_exit": self.last_exit,
        }
