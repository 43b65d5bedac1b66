"""Passive health of one engine: a circuit breaker fed by the outcome of real attempts, and a
backpressure window fed by the engine's own 429/503 answers.  Pure: ``now`` is passed in.

* ``closed``: the engine takes work.  Each failed attempt (error, broken or malformed stream,
  first-token timeout) adds one to ``failures``; a good first token resets it.  At
  ``breaker_failures`` in a row the breaker opens.
* ``open``: no new work until ``open_until``; the open period starts at ``breaker_open_s`` and
  doubles with each reopen (at most ``breaker_max_open_s``).
* ``probing``: the open period is over; the scheduler sends one small request of its own (a
  probe).  Success closes the breaker (and resets the period); failure opens it again, longer.
  The engine takes no client work while probing, so no client pays for the probe.

Backpressure (an engine's 429 or 503) is not a failure: it keeps the engine out of new placements
for the engine's ``Retry-After`` (or ``backpressure_s``), capped, and leaves the breaker alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from narwhal_serve.config import MonitoringConfig
from narwhal_serve.engines.errors import FaultKind

BACKPRESSURE_CAP_S = 10.0
MAX_DOUBLINGS = 32  # a breaker's open period doubles at most this many times (then breaker_max_open_s caps it)



@dataclass
class Breaker:
    state: Literal["closed", "open", "probing"] = "closed"
    failures: int = 0  # consecutive failed attempts
    open_until: float = 0.0
    open_s: float = 0.0  # the current (or last) open period
    opened: int = 0  # times opened since the engine last worked
    backpressure_until: float = 0.0
    last_fault: str = ""
    faults_total: dict[str, int] = field(default_factory=dict)  # by kind, ever (/metrics)
    probes_total: dict[str, int] = field(default_factory=dict)  # by result, ever (/metrics)

    def takes_work(self, now: float) -> bool:
        return self.state == "closed" and now >= self.backpressure_until

    def on_fault(self, kind: FaultKind, now: float, cfg: MonitoringConfig, retry_after_s: float | None = None,
                 why: str = "", may_open: bool = True) -> None:
        """``may_open``: the fleet can spare this engine (see :func:`may_open`); otherwise the
        failure is counted and the breaker opens at the first failure once it can, and a
        backpressure window is not started."""
        self.faults_total[kind] = self.faults_total.get(kind, 0) + 1
        if kind == "backpressure":
            if not may_open:  # the rest of the fleet is out already: the engine keeps taking work
                return
            hold = cfg.backpressure_s if retry_after_s is None else retry_after_s
            self.backpressure_until = max(self.backpressure_until, now + min(max(hold, 0.0), BACKPRESSURE_CAP_S))
            return
        self.last_fault = why or kind
        self.failures += 1
        if self.state == "closed" and self.failures >= cfg.breaker_failures and may_open:
            self._open(now, cfg)

    def on_success(self) -> None:
        """A real attempt produced a good first token: the engine works."""
        self.failures = 0
        if self.state != "probing":  # a probe's own answer decides a probing breaker
            self.state = "closed"
            self.opened = 0

    def probe_due(self, now: float) -> bool:
        """The open period is over: the caller starts one probe (the breaker is now probing)."""
        if self.state == "open" and now >= self.open_until:
            self.state = "probing"
            return True
        return False

    def on_probe(self, ok: bool, now: float, cfg: MonitoringConfig, why: str = "") -> None:
        if self.state != "probing":
            return
        result = "ok" if ok else "failed"
        self.probes_total[result] = self.probes_total.get(result, 0) + 1
        if ok:
            self.state = "closed"
            self.failures = 0
            self.opened = 0
        else:
            self.last_fault = why or "probe failed"
            self._open(now, cfg)

    def _open(self, now: float, cfg: MonitoringConfig) -> None:
        # (the doubling stops at the cap: an engine down for a day must not overflow it)
        self.open_s = min(cfg.breaker_max_open_s, cfg.breaker_open_s * (2 ** min(self.opened, MAX_DOUBLINGS)))
        self.opened += 1
        self.state = "open"
        self.open_until = now + self.open_s

    def view(self, now: float) -> dict[str, object]:
        return {
            "breaker": "closed" if self.state == "closed" else "open",
            "breaker_open": int(self.state != "closed"),
            "breaker_state": self.state,
            "consecutive_failures": self.failures,
            "open_for_s": round(max(0.0, self.open_until - now), 3) if self.state != "closed" else None,
            "backpressure_for_s": round(self.backpressure_until - now, 3) if now < self.backpressure_until else None,
            "last_fault": self.last_fault or None,
            "faults_total": dict(self.faults_total),
            "probes_total": dict(self.probes_total),
        }


def may_open(open_now: int, engines: int, cfg: MonitoringConfig) -> bool:
    """May one more breaker open, with ``open_now`` of ``engines`` open already?  At most
    ``breaker_max_open_fraction`` of them (at least one), and never the last engine."""
    cap = min(engines - 1, max(1, int(engines * cfg.breaker_max_open_fraction)))
    return open_now < cap
