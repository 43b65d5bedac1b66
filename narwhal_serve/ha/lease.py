"""The router's own lease (one active router per lease key), judged on its own monotonic clock.

A lease backend (:mod:`narwhal_serve.ha.redis_lease`) answers each acquire-or-renew call with
who holds the lease and under which *epoch* — the fencing token, incremented at every new
acquisition.  This module turns those answers into the router's mode, with no I/O:

* ``active`` — this router holds the lease and its last renewal is young enough: it was *sent* at
  ``t`` (monotonic), so the backend's expiry is no earlier than ``t + ttl_s``; the router stops
  admitting at ``t + ttl_s - margin``, before any other router can acquire the lease.
* ``fenced`` — it held the lease but could not renew in time (the backend unreachable, or the
  process paused): it admits nothing, and never again under that epoch.
* ``standby`` — another router holds the lease (or nobody has answered yet).

Leases handed to ingress replicas never outlive :meth:`RouterLease.remaining`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LeaseMode = Literal["active", "fenced", "standby"]


def safety_margin(ttl_s: float) -> float:
    """How long before the backend's expiry the holder stops: covers clock-rate differences."""
    return 0.1 * ttl_s


@dataclass
class RouterLease:
    holder_id: str
    ttl_s: float
    epoch: int = 0  # the epoch this router holds (0: none)
    valid_until: float = 0.0  # monotonic: admitting stops here unless renewed
    fenced_epoch: int = 0  # an epoch this router lost without handing it over
    seen_epoch: int = 0  # the highest epoch seen (passed to the backend, so epochs never repeat)
    holder: str | None = None  # who holds the lease, as last answered
    last_error: str | None = None  # why the last call failed, while it keeps failing
    acquisitions: int = 0

    def on_answer(self, won: bool, epoch: int, holder: str | None, sent_at: float) -> None:
        """The backend answered a call sent at ``sent_at`` (monotonic)."""
        self.last_error = None
        self.seen_epoch = max(self.seen_epoch, epoch)
        self.holder = holder
        if won and epoch == self.fenced_epoch:
            return  # a late answer for the epoch it lost: never again under it (the next renewal takes a new one)
        if won:
            if epoch != self.epoch:
                self.acquisitions += 1
                self.fenced_epoch = 0
            self.epoch = epoch
            self.valid_until = sent_at + self.ttl_s - safety_margin(self.ttl_s)
        else:
            self.epoch = 0
            self.valid_until = 0.0
            self.fenced_epoch = 0

    def released(self) -> None:
        """This router handed its lease over (or tried to, stopping): it admits nothing more under
        it — another router may take the lease once the admission leases granted under it end."""
        self.epoch = 0
        self.valid_until = 0.0
        self.fenced_epoch = 0
        self.holder = None

    def on_error(self, why: str) -> None:
        """The call failed: nothing changes until ``valid_until`` passes."""
        self.last_error = why

    def mode(self, now: float) -> LeaseMode:
        if self.epoch and now < self.valid_until:
            return "active"
        if self.epoch:  # held, not renewed in time
            self.fenced_epoch = self.epoch
            self.epoch = 0
        return "fenced" if self.fenced_epoch else "standby"

    def remaining(self, now: float) -> float:
        """Seconds this router may still admit under its lease (0 when not active)."""
        return max(0.0, self.valid_until - now) if self.mode(now) == "active" else 0.0

    def view(self, now: float) -> dict[str, object]:
        mode = self.mode(now)
        return {
            "mode": mode,
            "epoch": self.epoch or None,
            "fenced_epoch": self.fenced_epoch or None,
            "holder": self.holder,
            "holder_id": self.holder_id,
            "remaining_s": round(self.remaining(now), 3),
            "last_error": self.last_error,
            "acquisitions": self.acquisitions,
        }
