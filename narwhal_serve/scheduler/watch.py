"""Placement news for the ingress leases: each lease parks one ``watch`` call here, answered as
soon as another holder placed requests (another lease's report carried local placements, or the
scheduler placed a request itself).  The answer makes that ingress report at once, and the
report's answer brings it a view with those placements: a lease decides on the others'
placements of about one report ago, not of its own last report (up to ``renew_s`` ago when it
is quiet).  docs/architecture.md, "Admission leases".

Memory is O(1) in the number of leases: the latest placement (its sequence number and holder),
and the latest one by a holder other than that one, answer "what is the newest placement not
yours" for every lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


WATCH_S = 5.0  # a parked watch is answered after this long with no news (the ingress parks again)


class PlacementWatch:
    def __init__(self) -> None:
        self.seq = 0
        self._last_by: str | None = None  # holder of placement number ``_last`` (None: the scheduler)
        self._last = 0
        self._other = 0  # the newest placement by a holder other than ``_last_by``
        self._waiting: dict[str, asyncio.Future[int]] = {}

    def newest_not_by(self, lease_id: str) -> int:
        """The number of the newest placement another holder made (0: none yet)."""
        return self._other if self._last_by == lease_id else self._last

    def placed(self, holder: str | None) -> None:
        """``holder`` (a lease, or None for the scheduler itself) placed one or more requests."""
        self.seq += 1
        if holder != self._last_by:
            self._other = self._last
        self._last_by, self._last = holder, self.seq
        for lease_id, fut in list(self._waiting.items()):
            if lease_id != holder and not fut.done():
                fut.set_result(self.seq)

    async def wait(self, lease_id: str, seen: int, timeout_s: float = WATCH_S,
                   on_park: Callable[[], None] | None = None) -> int:
        """The newest placement another holder made, once it is newer than ``seen`` (at once when
        it is already), or ``seen``-or-older news after ``timeout_s``.  One parked call per lease:
        a newer one answers the older.  ``seen`` past every number given here came from a scheduler
        before this one: answered at once with this one's."""
        news = self.newest_not_by(lease_id)
        if news > seen or seen > self.seq:  # (a number from before this scheduler started: its own now)
            return news
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        old = self._waiting.pop(lease_id, None)
        if old is not None and not old.done():
            old.set_result(news)
        self._waiting[lease_id] = fut
        if on_park is not None:
            on_park()
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            return self.newest_not_by(lease_id)
        finally:
            if self._waiting.get(lease_id) is fut:
                del self._waiting[lease_id]

    def parked(self) -> int:
        return len(self._waiting)
