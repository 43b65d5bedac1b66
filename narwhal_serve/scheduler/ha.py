"""What makes the router refuse everything by itself: its lease (standby, fenced) and its own
monitoring (monitoring_degraded).  The scheduler owns one :class:`RouterHA`.

* Lease (``ha.lease.backend: redis``): a loop calls the backend's acquire-or-renew every
  ``renew_s``; :class:`~narwhal_serve.ha.lease.RouterLease` turns the answers into the mode.  A
  ``standby`` role hint waits one renewal before its first try, so a pair started together gives
  the lease to the router meant to be active.
* Monitoring-degraded: the router cannot trust its projections when too few engines have fresh
  data — fewer than ``monitoring.min_fresh_fraction`` of the engines outside maintenance have
  answered their last scrape within ``stale_after_s`` (an engine that refuses connections or says
  it is unhealthy *has* answered: that is a down engine, 503 ``backend_unavailable``, not a dark
  one) — or when the monitor loop itself has not completed a pass for ``max(3 × scrape_interval_s,
  stale_after_s)``.  Both recover by themselves when data is fresh again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.ha.lease import LeaseMode, RouterLease
from narwhal_serve.ha.redis_lease import RedisLease
from narwhal_serve.placement.engines import EngineState

log = logging.getLogger("narwhal.ha")


def holder_id() -> str:
    """Unique per router process start: host, pid and a random tag."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


class RouterHA:
    def __init__(self, cfg: NarwhalConfig, *, mono: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.mono = mono
        lc = cfg.ha.lease
        self.lease = RouterLease(holder_id(), lc.ttl_s) if lc.backend == "redis" else None
        self.backend: RedisLease | None = None
        self.last_pass: float | None = None  # wall clock: the monitor loop's last completed pass
        self.degraded_why: str | None = None
        self._degraded_kind: str | None = None
        self._last_mode: str | None = None
        self._giving_up = False  # draining: stop renewing (the lease is released)
        self._released = False
        self._grants_until = 0.0  # monotonic: when the last admission lease it granted its ingress replicas ends
        self._releasing = False  # the release has begun: no more admission leases
        # one backend call at a time: a release waits for the renewal in flight (one that reached
        # Redis after the release would take the lease again, and nobody would release it)
        self._calls = asyncio.Lock()

    # -- lease --------------------------------------------------------------------------------
    def lease_mode(self) -> LeaseMode | None:
        """``None`` without a lease backend (one router: ``ha.role`` and the admin route decide)."""
        if self.lease is None:
            return None
        mode = self.lease.mode(self.mono())
        if mode != self._last_mode:
            self._last_mode = mode
            log.warning("router lease: %s (epoch %s, holder %s%s)", mode, self.lease.epoch or self.lease.fenced_epoch,
                        self.lease.holder, f", {self.lease.last_error}" if self.lease.last_error else "")
        return mode

    def epoch(self) -> int:
        """The fencing token requests are placed under (0 without a lease backend)."""
        return self.lease.epoch if self.lease is not None and self.lease_mode() == "active" else 0

    def ingress_ttl(self, cap: float) -> float:
        """How long an ingress lease granted now may admit: never past the router's own lease."""
        if self.lease is None:
            return cap
        if self._releasing:  # (what it grants now would outlive the key the release shortens)
            return 0.0
        now = self.mono()
        ttl = min(cap, self.lease.remaining(now))
        self._grants_until = max(self._grants_until, now + ttl)
        return ttl

    async def run(self, on_change: Callable[[], None]) -> None:
        """Acquire or renew every ``renew_s`` until cancelled."""
        if self.lease is None:
            return
        lc = self.cfg.ha.lease
        if self.cfg.ha.role == "standby":
            await asyncio.sleep(lc.renew_s)
        loop = asyncio.get_running_loop()
        try:
            while not self._giving_up:
                # every renew_s from the last one's start: a renewal that timed out (renew_s) is
                # followed by the next at once, 2 × renew_s after the last good one, within the lease
                started = loop.time()
                try:
                    if self._connect():
                        renewal = asyncio.ensure_future(self.renew_once())
                        try:
                            await asyncio.shield(renewal)
                        except asyncio.CancelledError:
                            # stopping: the renewal already sent is answered first (bounded by
                            # renew_s), else the release could reach Redis before it and the
                            # renewal take the lease back for a router that stopped (a second
                            # cancel does not cut it short either: asyncio.wait cancels nothing)
                            while not renewal.done():
                                with contextlib.suppress(asyncio.CancelledError):
                                    await asyncio.wait({renewal})
                            raise
                    on_change()
                except Exception:  # (one fault must not end the renewals: the lease would lapse for good)
                    log.exception("router lease: renewal pass failed")
                await asyncio.sleep(max(0.0, lc.renew_s - (loop.time() - started)))
        finally:
            await self.release()

    def _connect(self) -> bool:
        """The backend's client, made once (a failure says why in ``last_error``, and is tried again)."""
        if self.backend is None and not self._released and self.lease is not None:
            lc = self.cfg.ha.lease
            try:
                self.backend = RedisLease(lc.url or "", lc.key, timeout_s=lc.renew_s)
            except Exception as exc:
                self.lease.on_error(f"{type(exc).__name__}: {exc}"[:200])
                self.lease_mode()
        return self.backend is not None

    def give_up(self) -> None:
        """Draining: renew no more (:meth:`release` hands the lease over now)."""
        self._giving_up = True

    async def renew_once(self) -> None:
        async with self._calls:
            if self.lease is None or self.backend is None:
                return
            lc = self.cfg.ha.lease
            sent = self.mono()
            held = self.lease.epoch if self.lease.mode(sent) == "active" else 0
            try:
                async with asyncio.timeout(lc.renew_s):
                    ans = await self.backend.acquire_or_renew(self.lease.holder_id, lc.ttl_s, self.lease.seen_epoch, held)
            except Exception as exc:  # Redis unreachable, slow, or failing: keep the lease until it lapses
                self.lease.on_error(f"{type(exc).__name__}: {exc}"[:200])
            else:
                self.lease.on_answer(ans.won, ans.epoch, ans.holder, sent)
            self.lease_mode()  # log a transition

    async def release(self) -> None:
        """Hand the lease over at once on a clean stop (best effort), after the renewal in flight."""
        self._releasing = True
        async with self._calls:
            self._released = True
            if self.lease is None or self.backend is None:
                return
            try:
                now = self.mono()
                if self.lease.mode(now) == "active":
                    # the key lives on until the admission leases granted under it end: they may
                    # admit till then, and the standby must not before (one active at a time)
                    keep_ms = math.ceil(max(0.0, self._grants_until - now) * 1000)
                    async with asyncio.timeout(self.cfg.ha.lease.renew_s):
                        await self.backend.release(self.lease.holder_id, self.lease.epoch, keep_ms)
            except Exception:
                log.warning("could not release the router lease; it lapses after ha.lease.ttl_s")
            finally:
                self.lease.released()  # (admitting under it stops now: the standby may take it at once)
                self.lease_mode()
                await self.backend.close()
                self.backend = None

    # -- monitoring ---------------------------------------------------------------------------
    def degraded(self, engines: Iterable[EngineState], now: float, maintenance: frozenset[str]) -> str | None:
        """Why the router's view cannot be trusted now, or None."""
        return self.degraded_until(engines, now, maintenance)[0]

    def degraded_until(self, engines: Iterable[EngineState], now: float, maintenance: frozenset[str]
                       ) -> tuple[str | None, float]:
        """:meth:`degraded`, and until when a None stays None if nothing but time changes (no
        monitor pass, no engine's data older than now, the same engines and waves): the monitor
        loop's stall, or the time at which so many engines' data will have aged that too few are
        fresh.  ``now`` itself when degraded (recovery comes with data, not time)."""
        mon = self.cfg.monitoring
        stalled_after = max(3 * mon.scrape_interval_s, mon.stale_after_s)
        why: str | None = None
        kind: str | None = None  # what is logged: a change of kind, not of the numbers in `why`
        sure = math.inf
        if self.last_pass is not None and now - self.last_pass > stalled_after:
            why, kind = f"monitor loop stalled for {now - self.last_pass:.1f} s", "stalled"
        elif self.last_pass is not None:
            sure = self.last_pass + stalled_after
            watched = [e for e in engines if e.cfg.wave not in maintenance]
            if watched:
                n = len(watched)
                seen = sum(1 for e in watched if e.answered(now, mon.stale_after_s))
                if seen / n < mon.min_fresh_fraction:
                    why, kind = f"fresh data from {seen} of {n} engines", "stale"
                else:
                    # each engine answered (fresh data or a definite "down") until then; the m-th
                    # earliest, m the fewest engines whose data may age before too few are fresh,
                    # is the last instant the fraction holds
                    until = sorted(max(-math.inf if e.last_ok is None else e.last_ok + mon.stale_after_s,
                                       -math.inf if e.last_answer is None else e.last_answer + mon.stale_after_s)
                                   for e in watched)
                    m = n - seen + 1
                    while m <= n and (n - m) / n >= mon.min_fresh_fraction:
                        m += 1
                    if m <= n:
                        sure = min(sure, until[m - 1])
        if kind != self._degraded_kind:
            if why is not None:
                log.warning("monitoring degraded: %s", why)
            else:
                log.warning("monitoring recovered")
            self._degraded_kind = kind
        self.degraded_why = why
        return why, (now if why is not None else sure)

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.cfg.ha.lease.backend, "role_hint": self.cfg.ha.role,
                               "monitoring_degraded": self.degraded_why}
        if self.lease is not None:
            out.update(self.lease.view(self.mono()), key=self.cfg.ha.lease.key, ttl_s=self.cfg.ha.lease.ttl_s,
                       renew_s=self.cfg.ha.lease.renew_s)
        return out
