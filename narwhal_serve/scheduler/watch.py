"""Placement news for the ingress leases: each lease parks one ``watch`` call here, answered when
another holder placed requests (another lease's report carried local placements, or the scheduler
placed a request another lease asked for) that the lease's view lacks, once the lease has been
quiet for ``quiet_s``.  The answer makes that ingress report at once, and the report's answer
brings it a view with those placements: a lease decides on the others' placements of about one
report ago, not of its own last report (up to ``renew_s`` ago when it is quiet).  A lease that
reports on its own within ``quiet_s`` (a busy one) hears the news with that report and is not
called: at high rates the news costs no extra reports.  docs/architecture.md, "Admission leases".
"""

from __future__ import annotations

import asyncio
import math


WATCH_S = 5.0  # a parked watch is answered after this long with no news (the ingress parks again)
QUIET_S = 0.01  # a lease silent this long hears news at once; one reporting sooner, with its report


def _loop_time() -> float:
    """The event loop's clock (the replay's is virtual); none running (a report handled outside
    one, in tests): no watch can be parked either."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return -math.inf


class PlacementWatch:
    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self.quiet_s = quiet_s
        self.seq = 0
        self._last_by: str | None = None  # holder of placement number ``_last`` (None: the scheduler's own)
        self._last = 0
        self._other = 0  # the newest placement by a holder other than ``_last_by``
        self._heard: dict[str, int] = {}  # lease -> the newest placement its view holds (its last report's)
        self._reported: dict[str, float] = {}  # lease -> when its last report was answered (loop time)
        self._waiting: dict[str, asyncio.Future[bool]] = {}
        self._due: dict[str, asyncio.TimerHandle] = {}

    def newest_not_by(self, lease_id: str) -> int:
        """The number of the newest placement another holder made (0: none yet)."""
        return self._other if self._last_by == lease_id else self._last

    def placed(self, holder: str | None) -> None:
        """``holder`` (a lease, or None for a request no lease asked for) placed one or more requests."""
        self.seq += 1
        if holder != self._last_by:
            self._other = self._last
        self._last_by, self._last = holder, self.seq
        for lease_id in list(self._waiting):
            if lease_id != holder:
                self._check(lease_id)

    def reporting(self, lease_id: str) -> None:
        """``lease_id``'s report is being handled: its answer will hold what is placed meanwhile
        (the scheduler's queue may place other leases' requests as the report frees permits), so
        news of those waits for :meth:`reported` instead of calling the lease for them."""
        self._reported[lease_id] = _loop_time()

    def reported(self, lease_id: str) -> None:
        """``lease_id``'s report is answered: its view holds every placement so far."""
        self._heard[lease_id] = self.seq
        self._reported[lease_id] = _loop_time()
        self._cancel_due(lease_id)

    def forget(self, lease_id: str) -> None:
        """A lease gone (its ingress silent past the orphan limit)."""
        self._heard.pop(lease_id, None)
        self._reported.pop(lease_id, None)
        self._cancel_due(lease_id)
        fut = self._waiting.pop(lease_id, None)
        if fut is not None and not fut.done():
            fut.set_result(False)

    def _check(self, lease_id: str) -> None:
        fut = self._waiting.get(lease_id)
        if fut is None or fut.done() or self.newest_not_by(lease_id) <= self._heard.get(lease_id, 0):
            return
        loop = fut.get_loop()  # (a placement may come from code run outside the loop: tests)
        due = self._reported.get(lease_id, -math.inf) + self.quiet_s
        if loop.time() >= due:
            self._cancel_due(lease_id)
            fut.set_result(True)
        elif lease_id not in self._due:  # (its own report before then brings it the news instead)
            self._due[lease_id] = loop.call_at(due, self._on_due, lease_id)

    def _cancel_due(self, lease_id: str) -> None:
        timer = self._due.pop(lease_id, None)
        if timer is not None:
            timer.cancel()

    def _on_due(self, lease_id: str) -> None:
        self._due.pop(lease_id, None)
        self._check(lease_id)

    async def wait(self, lease_id: str, timeout_s: float = WATCH_S) -> bool:
        """Parked until news for ``lease_id`` (True), or ``timeout_s`` (False).  One parked call
        per lease: a newer one answers the older (False)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        old = self._waiting.pop(lease_id, None)
        if old is not None and not old.done():
            old.set_result(False)
        self._waiting[lease_id] = fut
        self._check(lease_id)  # (news it has not heard may be here already)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            return False
        finally:
            if self._waiting.get(lease_id) is fut:
                del self._waiting[lease_id]

    def parked(self) -> int:
        return len(self._waiting)
