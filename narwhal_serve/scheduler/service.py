"""The scheduler: single source of truth for engines, router state, admission and counters.

Plain asyncio, no Ray: the Ray deployment (``deployments/scheduler.py``) only forwards calls here,
and tests drive it directly.  Admission decisions are :func:`narwhal_serve.admission.core.decide`,
the same pure function ingress replicas run under their leases (:mod:`.leases`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from narwhal_serve.admission import ledger
from narwhal_serve.admission.wire import LeaseGrant
from narwhal_serve.placement.prefix import index_capacity
from narwhal_serve.protocol.estimate import CHARS_PER_TOKEN
from narwhal_serve.relay.messages import EngineWorked
from narwhal_serve.scheduler.admin import AdminOps
from narwhal_serve.scheduler.health import apply_health, update_drift
from narwhal_serve.scheduler.leases import LEASE_TTL_S
from narwhal_serve.scheduler.messages import Report
from narwhal_serve.scheduler.monitor import scrape_all
from narwhal_serve.scheduler.snapshot import snapshot
from narwhal_serve.telemetry import render_metrics
from narwhal_serve.tokenization.sizer import tokenizer_path


log = logging.getLogger("narwhal.monitor")

REAP_GRACE_S = 5.0  # a ticket past its request deadline by this much is forgotten (permits freed)


class SchedulerService(AdminOps):
    """The scheduler: its state and jobs (the modules it builds on), its lifecycle — the monitoring
    loop, probes, reaping — and the ingress replicas' reports."""

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.kv_events.start(self.engines.values())
        if self._monitor is None:
            self.client()
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop())
        if self._ha is None and self.ha.lease is not None:
            self._ha = asyncio.get_running_loop().create_task(self.ha.run(self._pump))

    async def stop(self) -> None:
        await self.kv_events.stop()
        self.prober.cancel()
        self.profiler.cancel()
        for t in list(self._background):
            t.cancel()
        if self._ha is not None:
            self._ha.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ha  # hands the lease over (release) on the way out
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self._client is not None:
            await self._client.aclose()

    async def _monitor_loop(self) -> None:
        while True:
            try:
                await self.scrape_once()
                self.reap()
                self.start_probes()
            except Exception:  # one odd engine answer or pass ends this pass, never the monitoring
                log.exception("monitoring pass failed")
            await asyncio.sleep(self.cfg.monitoring.scrape_interval_s)

    def start_probes(self) -> None:
        """A probe for each engine whose breaker has been open its full period."""
        self.prober.start_due(self.engines.values(), self.client())
        if self.cfg.admission.mode == "predictive":  # open mode judges nothing by the engines' models
            for name in update_drift(self.engines, self.clock(), self.cfg, frozenset(self.router.maintenance)):
                self.touch(name)  # (the leases' views hear of it with the next grant)
            self.profiler.start_due(self.engines.values(), self.client())

    async def scrape_engines(self) -> None:
        """``/health`` and ``/metrics`` of every engine, over HTTP (the trace replay's engines answer in-process)."""
        await scrape_all(
            self.client(), list(self.engines.values()), self.clock(), self.cfg.monitoring.scrape_timeout_s
        )

    async def scrape_once(self) -> None:
        await self.scrape_engines()
        pl = self.cfg.placement
        learned = self.learned_block_tokens
        for e in self.engines.values():  # an index never remembers more than the engine's KV cache holds
            if e.prefix_exact:
                e.prefix.resize(max(pl.prefix_index_blocks, e.load.kv_tokens // pl.prefix_block_tokens))
                continue
            e.prefix.resize(index_capacity(pl.prefix_index_blocks, e.load.kv_tokens, learned))
        for e in [e for e in self.engines.values() if e.managed is not None and e.managed.state == "down"]:
            if self.managed.leave_if_done(e):  # an extra slot gone with its replica, its last request ended
                self.kv_events.drop(e.cfg.name)
        self.router.started = True
        self.ha.last_pass = self.clock()
        self.views_stale()  # every engine's load and health read anew
        self._pump()  # engines may have become eligible for queued requests

    @functools.cached_property
    def learned_block_tokens(self) -> float:
        """The tokens a learned block stands for: the ingress hashes prompts in blocks of tokens
        where it tokenizes them, else of characters (placement/prefix.py request_prefix). The
        configuration is fixed for the scheduler's life: read once, not on every pass."""
        pl = self.cfg.placement
        return pl.prefix_block_tokens if tokenizer_path(self.cfg) is not None else pl.prefix_block_chars / CHARS_PER_TOKEN

    def reap(self) -> None:
        """Bound every ticket's life: forget tickets long past their deadline, and leases (with
        their tickets) whose ingress went silent."""
        now = self.clock()
        for lease_id, rec in self.leases.orphans(now):
            self.tenants.forget_lease(lease_id)
            self.placement_watch.forget(lease_id)
            for tid in list(rec.tickets):
                self._release(tid, None)
        for tid in [t for t, k in self._tickets.items() if now > k.deadline + REAP_GRACE_S]:
            self._release(tid, None)
        self._pump()

    def report(self, rep: Report) -> LeaseGrant | None:
        """Applied once, whatever fails in it: an exception that reached the ingress would have it
        send the report again whole (counters merged twice, placements charged twice and released
        once: an engine's in-flight count off for good), so a fault part-way is logged and counted
        (``calls.report_failed``), and the lease is renewed by its next report."""
        self.calls["report"] += 1
        try:
            return self._report(rep)
        except Exception:
            self.calls["report_failed"] += 1
            log.exception("a report failed part-way; applied as far as it went, not to be sent again")
            return None

    def _report(self, rep: Report) -> LeaseGrant | None:
        now = self.clock()
        self.counters.merge(rep.counters)
        grant_for = None
        if rep.lease is not None:
            part = rep.lease
            self.placement_watch.reporting(part.lease_id)  # (what is placed from here on, its answer holds)
            rec, fresh = self.leases.touch(part.lease_id, part.in_use, now)
            self.leases.returned(part.lease_id, part.returned, part.epoch)
            if part.tenants is not None:
                self.tenants.lease_report(part.lease_id, part.tenants, now, fresh=fresh or part.epoch != rec.epoch)
            for lp in part.placed:
                self._local_placed(lp, part.lease_id)
            if part.placed:
                self.placement_watch.placed(part.lease_id)  # the other leases hear of it now
            for r in part.reserved:
                self._reserve(r)
            for rid in part.consumed:
                self.reservations.pop(rid, None)
            grant_for = (rec, fresh)
        for h in rep.health:  # (a fault may take engines out: apply_health weighs the fleet's spare)
            for name in h.engines if isinstance(h, EngineWorked) else (h.engine,):
                self.touch(name)
        for name in apply_health(self.engines, rep.health, now, self.cfg, frozenset(self.router.maintenance)):
            self.tripped[name] = now  # (ingress replicas resume the streams still on it)
        for tid, engines in rep.decode_started:
            self.admission.enter_decode(tid)
            t = self._tickets.get(tid)
            if t is not None:
                if not t.prefill_done and engines == t.placement.engines and self.cfg.placement.prefix_aware \
                        and (e := self.engines.get(t.placement.first_engine or "")) is not None:
                    # its prefill is done: the engine holds its blocks now, just used (an engine's
                    # own KV events say which it holds: those are only the most recently used now)
                    if e.prefix_exact:  # (its first block last: the prompt's start is the most recent)
                        e.prefix.touch(reversed(t.placement.prefix))
                    else:
                        e.prefix.learn(t.placement.prefix)
                    self.touch(e.cfg.name)
                self._ticket_event(tid, t, lambda t: ledger.first_token(t, engines, self.clock()))  # (called at once)
                if t.decode_engine is not None:  # it holds a slot there now (its slot releases)
                    self.touch(t.decode_engine)
        for tid, tokens in rep.progress.items():
            self._progress(tid, tokens)
        for tid, stats, completed in rep.released:
            self._release(tid, stats, completed)
        for w in rep.admission_waits:
            self.histograms["admission_wait"].observe(w)
        self._pump()
        if grant_for is None or rep.lease is None:
            return None
        rec, _ = grant_for
        self.placement_watch.reported(rep.lease.lease_id)  # (its grant holds every placement so far)
        granted, target = self.leases.grant(rec, bool(self.admission.queue))
        shares, targets = self.tenants.grant(rep.lease.lease_id, now, len(self.leases.leases))
        (view, prefixes, rows), seq, base, names = self.leases.view_for(
            rec, rep.lease.view_seq, lambda: (self.granted.seq, self.granted.members), lambda: tuple(self.engines),
            lambda since, held: self.grant_view(now, since, held))
        return LeaseGrant(rep.lease.lease_id, rep.lease.generation, view, now,
                          self.ha.ingress_ttl(LEASE_TTL_S), granted, target, epoch=rec.epoch,
                          tenant_granted=shares, tenant_targets=targets, tenant_facts=self.tenants.facts(now),
                          view_seq=seq, view_base=base, names=names, prefixes=prefixes, rows=rows)

    async def watch(self, lease_id: str) -> bool:
        """A lease's parked call: True once another holder placed requests its view lacks and it
        has been quiet a moment, False after a while without (:mod:`.watch`)."""
        self.calls["watch"] += 1
        return await self.placement_watch.wait(lease_id)

    def metrics_text(self) -> str:
        return render_metrics(self.snapshot(), self.histograms)

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self)
