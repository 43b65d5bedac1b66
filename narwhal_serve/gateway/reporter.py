"""Batches an ingress replica's reports to the scheduler ("gated": send now if no call is in flight,
else as soon as it returns), from a task with a fresh context so that Ray Serve's cancellation of a
client's request never cancels a release (ARCHITECTURE.md, "cancellation trap")."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

from narwhal_serve.admission.outcomes import Outcome
from narwhal_serve.relay.messages import RelayStats
from narwhal_serve.scheduler.messages import Report

log = logging.getLogger(__name__)


class Reporter:
    def __init__(self, send: Callable[[Report], Awaitable[None]]) -> None:
        self._send = send
        self._pending = Report()
        self._wake = asyncio.Event()
        self._sent = 0  # reports handed to the scheduler
        self._queued = 0  # reports ever queued
        self._flushed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._loop(), context=contextvars.Context())

    def _queue(self) -> None:
        self._queued += 1
        self._wake.set()
        self._ensure_task()

    # -- what the gateway reports -------------------------------------------------------------
    def offered(self) -> None:
        self._pending.counters.offered += 1
        self._queue()

    def unsized(self) -> None:
        self._pending.counters.unsized_offered += 1
        self._queue()

    def outcome(self, outcome: Outcome, reason: str = "") -> None:
        self._pending.counters.add(outcome, reason)
        self._queue()

    def decode_started(self, ticket_id: str) -> None:
        self._pending.decode_started.append(ticket_id)
        self._queue()

    def admission_wait(self, seconds: float) -> None:
        self._pending.admission_waits.append(seconds)
        self._queue()

    def release(self, ticket_id: str, outcome: Outcome, reason: str, stats: RelayStats | None) -> None:
        self._pending.counters.add(outcome, reason)
        self._pending.released.append((ticket_id, stats))
        self._queue()

    async def flush(self) -> None:
        """Wait until everything reported so far has reached the scheduler."""
        target = self._queued
        self._ensure_task()
        async with self._flushed:
            await self._flushed.wait_for(lambda: self._sent >= target)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            rep, self._pending = self._pending, Report()
            upto = self._queued
            if not rep.empty():
                for attempt in range(5):
                    try:
                        await self._send(rep)
                        break
                    except Exception:  # the scheduler restarts or is busy: keep the report
                        log.exception("report to the scheduler failed (attempt %d)", attempt + 1)
                        await asyncio.sleep(0.05 * (attempt + 1))
            self._sent = upto
            async with self._flushed:
                self._flushed.notify_all()
