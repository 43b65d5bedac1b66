"""Batches an ingress replica's reports to the scheduler ("gated": send now if no call is in flight,
else as soon as it returns), from a task with a fresh context so that Ray Serve's cancellation of a
client's request never cancels a release (a cancelled request's own tasks are cancelled with it: the release is the reporter's, not the request's).

With an :class:`~narwhal_serve.admission.lease.AdmissionLease`, every report carries the lease's
share (its local placements, permits in use and given back) and the answer renews the lease; an
idle replica still reports every ``renew_s`` so that its lease and view stay fresh."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable

from narwhal_serve.config import AdmissionConfig
from narwhal_serve.admission.core import FleetView
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.messages import EngineFault, HealthEvent
from narwhal_serve.admission.wire import LeaseGrant
from narwhal_serve.scheduler.messages import Report

log = logging.getLogger(__name__)

# how long a report gathers events before it goes: admission.report_linger_s's default (10 ms
# measured no better for latency: the gated loop's round trip already batches under load,
# docs/performance.md).  Releases go at once while requests wait in the scheduler's queue (a
# freed permit admits the next one there).
LINGER_S: float = AdmissionConfig.model_fields["report_linger_s"].default
# how often a quiet replica reports anyway (each answer renews its lease, LEASE_TTL_S = 2 s): four
# tries per lease.  Each idle report woke both replicas' Ray machinery: at 0.25 s they cost about
# 1 % of a core in each (docs/performance.md, "Cost per request"); the news of others' placements
# comes at once by the watch call, not by this period.
RENEW_S = 0.5
STOP_SEND_S = 5.0  # how long a stop waits for a report already on its way


def _retrieved(f: "asyncio.Future[LeaseGrant | None]") -> None:
    """A send's outcome read (one that ends after a stop has nobody awaiting it)."""
    if not f.cancelled():
        f.exception()


class Reporter:
    def __init__(
        self,
        send: Callable[[Report], Awaitable[LeaseGrant | None]],
        *,
        linger_s: float = LINGER_S,
        lease: AdmissionLease | None = None,
        watch: Callable[[str], Awaitable[bool]] | None = None,
        renew_s: float = RENEW_S,
        clock: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self.lease = lease
        self._renew_s = renew_s
        self._clock = clock
        self._mono = mono
        self._linger_s = linger_s  # gather a request's events (offered, wait, release) into one call
        self._urgent = False
        self._pending = Report()
        self._wake = asyncio.Event()
        self._sent = 0  # reports handed to the scheduler
        self._queued = 0  # reports ever queued
        self._flushed = asyncio.Condition()
        self._ends = 0  # requests ended (released) so far
        self._ends_heard = 0  # of those, the ones in reports the scheduler has answered
        self._task: asyncio.Task[None] | None = None
        self._in_flight: asyncio.Future[LeaseGrant | None] | None = None  # the report on its way
        # the scheduler's placement news (scheduler/watch.py): another holder's placements make
        # this lease report at once, so that its view has them before its next decision
        self._watch = watch if lease is not None else None
        self._watcher: asyncio.Task[None] | None = None
        self._stopped = False
        self.news = 0  # news heard (each sent a report at once)
        self.on_view: Callable[[FleetView], None] | None = None  # each fresh lease view (the gateway's drain)

    def _ensure_task(self) -> None:
        if self._stopped:  # (a task finishing as stop() cancels it may queue more: none after a stop)
            return
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._loop(), context=contextvars.Context())
        if self._watch is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watching(), context=contextvars.Context())

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

    def outcome(self, outcome: Outcome, reason: str = "", tenant: str | None = None, klass: str | None = None) -> None:
        self._pending.counters.add(outcome, reason, tenant, klass)
        self._queue()

    def decode_started(self, ticket_id: str, engines: tuple[str, ...] = ()) -> None:
        self._pending.decode_started.append((ticket_id, engines))
        self._queue()

    def progress(self, ticket_id: str, tokens: int) -> None:
        """A stream's identified output tokens so far (decode correction): rides with the next
        report, the latest count per ticket."""
        self._pending.progress[ticket_id] = tokens
        if self.lease is not None:
            self.lease.progress(ticket_id, tokens)

    def resumes(self, cuts: tuple[tuple[str, str], ...]) -> None:
        """Answers cut mid-stream: (reason, outcome) each (docs/contract.md, "Engine failures")."""
        for key in cuts:
            self._pending.counters.resumes[key] += 1
        self._queue()

    def engine_health(self, events: tuple[HealthEvent, ...]) -> None:
        """First tokens and failed attempts, in order, for the engines' breakers; a failure is sent
        at once (it changes placement), a first token rides with the next report."""
        self._pending.health.extend(events)
        if any(isinstance(e, EngineFault) for e in events):
            self._urgent = True
        self._queue()

    def start(self) -> None:
        """Begin reporting now (a lease needs its first grant before it can admit)."""
        self._stopped = False
        self._wake.set()
        self._ensure_task()

    def start_once(self) -> None:
        if self._task is None and self.lease is not None:
            self.start()

    def admission_wait(self, seconds: float) -> None:
        self._pending.admission_waits.append(seconds)
        self._queue()

    def first_token(self, ticket_id: str, engines: tuple[str, ...]) -> None:
        """An admitted request's first token came from ``engines``: its lease frees its prefill
        permit, and the scheduler hears it with the next report."""
        if self.lease is not None:
            self.lease.first_token(ticket_id, engines)
        self.decode_started(ticket_id, engines)

    def ended(self, ticket_id: str, outcome: Outcome, reason: str, stats: RelayStats | None,
              tenant: str | None = None, klass: str | None = None) -> None:
        """An admitted request ended: its lease frees what it held (a request the lease admitted),
        and the scheduler hears it (:meth:`release`)."""
        if self.lease is not None:
            self.lease.release(ticket_id, stats.output_tokens if stats is not None else None)
        self.release(ticket_id, outcome, reason, stats, tenant, klass)

    def release(self, ticket_id: str, outcome: Outcome, reason: str, stats: RelayStats | None,
                tenant: str | None = None, klass: str | None = None) -> None:
        self._pending.counters.add(outcome, reason, tenant, klass)
        self._ends += 1
        self._pending.released.append((ticket_id, stats, outcome is Outcome.COMPLETED))
        view = self.lease.view if self.lease is not None else None
        if view is not None and view.queued:
            self._urgent = True  # requests wait at the scheduler: the freed permit is theirs now
        self._queue()

    def ends_unheard(self) -> bool:
        """Requests have ended that the scheduler has not heard of yet (their report is pending or
        on its way): what it counts in flight (a tenant's concurrent slots) is older than this."""
        return self._ends_heard < self._ends

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until everything reported so far has reached the scheduler (with a lease: and
        one fresh answer has renewed it) — at most ``timeout_s``: a scheduler that cannot be
        reached must not hang /ready, /status or the admin routes."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._flush()

    async def stop(self) -> None:
        """No more reports until :meth:`start` (what is pending stays unsent: :meth:`flush` first).
        A report already on its way goes on to the scheduler (up to ``STOP_SEND_S`` waited for):
        its counters and releases are nowhere else (a busy scheduler's answer outlasting the
        stop's flush cut it off, the counts lost with the replica)."""
        self._stopped = True
        sending = self._in_flight
        for task in (self._watcher, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._watcher = None
        if sending is not None and not sending.done():
            await asyncio.wait({sending}, timeout=STOP_SEND_S)

    async def _watching(self) -> None:
        """One parked watch call at a time; news of another holder's placements sends a report now
        (and the call parks again once its answer is in: the scheduler then knows what it heard)."""
        assert self._watch is not None and self.lease is not None
        backoff = 0.05
        while True:
            try:
                news = await self._watch(self.lease.lease_id)
                backoff = 0.05
            except Exception:  # the scheduler restarts or is busy: the renewals keep the view meanwhile
                log.debug("placement watch failed; again in %.2f s", backoff, exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            if news:
                self.news += 1
                await self.flush()

    async def _flush(self) -> None:
        if self.lease is not None:
            self._queued += 1
        target = self._queued
        self._urgent = True
        self._wake.set()
        self._ensure_task()
        async with self._flushed:
            await self._flushed.wait_for(lambda: self._sent >= target)

    async def _loop(self) -> None:
        backoff = 0.05
        while True:
            if self.lease is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._renew_s):
                        await self._wake.wait()
            if not self._urgent and self._linger_s > 0:
                await asyncio.sleep(self._linger_s)
            self._wake.clear()
            self._urgent = False
            rep, self._pending = self._pending, Report()
            upto, ends = self._queued, self._ends
            cut_at = self._mono()
            if self.lease is not None:
                rep.lease = self.lease.cut(cut_at)
            if not rep.empty():
                try:
                    # (shielded: a stop() while it is on its way lets it arrive, see stop)
                    self._in_flight = sending = asyncio.ensure_future(self._send(rep))
                    sending.add_done_callback(_retrieved)
                    grant = await asyncio.shield(sending)
                    backoff = 0.05
                except Exception:  # the scheduler restarts or is busy: keep the report for later
                    log.exception("report to the scheduler failed; retrying in %.2f s", backoff)
                    if self.lease is not None and rep.lease is not None:
                        self.lease.restore(rep.lease.generation)
                    rep.lease = None
                    rep.absorb(self._pending)
                    self._pending = rep
                    self._wake.set()
                    await asyncio.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                if self.lease is not None and grant is not None:
                    self.lease.apply(grant, self._clock(), cut_at)
                    if self.on_view is not None and self.lease.view is not None:
                        self.on_view(self.lease.view)
            self._sent, self._ends_heard = upto, ends
            async with self._flushed:
                self._flushed.notify_all()
