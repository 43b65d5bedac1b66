"""The scheduler's side of per-tenant budgets that hold for the whole router (docs/contract.md, "Tenants").
Pure: ``now`` passed in.

Each budgeted tenant has, per minute, a request, an input-token and an output-token budget, and a
concurrent-request limit.  Each per-minute budget is a token bucket: it holds at most its limit and
refills at limit/60 per second.  The scheduler keeps the buckets (:class:`TenantBook`); each ingress
lease holds a *share* of each active tenant's bucket (:class:`LeaseShares`), carved out of it, and
admits that tenant's requests locally while the share covers them — no scheduler call per request.

Why the bound is exact: a share is taken out of the bucket when it is granted, and a bucket refills
only up to its limit less the shares out (as last reported).  So what the whole router can admit in
any window of W seconds is at most the limit plus W × limit/60, however many ingress replicas share
it.  Output tokens are the exception, by the issue's rule: a stream is never cut for them; they are
charged as they are identified, and a tenant in debt (bucket below zero) is refused until the debt
is paid back by the refill.  The overshoot of output tokens is therefore what the streams in flight
generate after the bucket ran dry, paid back before the next request.

Retry-After a client can trust: a refusal says when the bucket will hold this request *after every
request promised before it*.  A client that says it retries (``X-Stainless-Retry-Count``: the
official SDKs) gets a *promise*: that room is kept for it until ``PROMISE_GRACE_S`` after its
Retry-After; new requests queue behind the promises.  A retry is recognised by its fingerprint (a
hash of its tenant and body: an SDK resends the same body) and takes its own promise; one that
comes back early keeps its place and is told the rest of its wait.  While a tenant has promises
outstanding, leases are given no share of it: the requests of clients that retry are decided by the
scheduler, which keeps the order exact, and a lease refuses the others itself when the bucket, less
what is promised, cannot hold them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from narwhal_serve.config import TenantSpec
from narwhal_serve.tenants.amounts import KINDS, NOTHING, Amounts
from narwhal_serve.tenants.messages import TenantFacts, TenantPart
from narwhal_serve.tenants.promises import EARLY_S, MAX_PROMISES, PROMISE_GRACE_S, PROMISE_HORIZON_S, Promise, Promises
from narwhal_serve.tenants.rules import (
    RATE_KINDS,
    BudgetRefusal,
    lacking,
    limited,
    ratelimit_headers,
    refilled,
    refusal,
)

SHARE_S = 1.0  # a lease's share covers about this long of the tenant's budget rate
ACTIVE_S = 10.0  # a lease that has not seen a tenant this long gets no share of it
DURATION_PRIOR_S = 1.0  # a tenant's request duration before any was measured (concurrency Retry-After)


@dataclass
class TenantState:
    """The scheduler's bucket of one tenant."""

    spec: TenantSpec
    level: Amounts  # rate kinds; concurrent unused (free slots are computed)
    at: float
    held: dict[str, Amounts] = field(default_factory=dict)  # lease → its share, as last reported
    lease_in_use: dict[str, int] = field(default_factory=dict)  # lease → its requests in flight
    active: dict[str, float] = field(default_factory=dict)  # lease → when it last saw this tenant
    in_use: int = 0  # requests in flight the scheduler admitted itself
    promises: Promises = field(default_factory=Promises)
    duration_s: float = DURATION_PRIOR_S  # EWMA of its requests' durations
    mean_cost: Amounts = Amounts(1.0, 1.0, 1.0, 1.0)  # EWMA of one request's cost

    def held_total(self) -> Amounts:
        total = NOTHING
        for a in self.held.values():
            total = total + a
        return total

    def free_slots(self) -> float:
        cap = self.spec.max_concurrent
        if cap is None:
            return math.inf
        held = sum(max(0.0, a.concurrent) for a in self.held.values())
        return cap - self.in_use - sum(self.lease_in_use.values()) - held

    def refill(self, now: float) -> None:
        self.level = refilled(self.spec, self.level, now - self.at, self.held_total())
        self.at = now

    def available(self) -> Amounts:
        free = self.free_slots()
        return Amounts(self.level.requests, self.level.input_tokens, self.level.output_tokens,
                       free if math.isfinite(free) else 0.0)

    def remaining(self) -> Amounts:
        """The whole router's remaining budget: the bucket and the shares out."""
        return self.level + self.held_total() + Amounts(concurrent=self.available().concurrent)

    def tight(self) -> bool:
        """The unshared bucket cannot cover a typical request of one of the budgeted kinds (or a
        concurrent slot): leases get no more share and give theirs back, so that what is left is
        decided in one place."""
        level = self.available()
        for kind in KINDS:
            if self.spec.limit(kind) is None:
                continue
            need = 1.0 if kind == "concurrent" else (0.0 if kind == "output_tokens" else self.mean_cost.get(kind))
            if level.get(kind) < need or (kind == "output_tokens" and level.get(kind) <= 0):
                return True
        return False

    def slot_wait_s(self) -> float:
        running = self.in_use + sum(self.lease_in_use.values())
        return self.duration_s / max(1, running)

    def live_promises(self, now: float) -> Promises:
        self.promises.expire(now)
        return self.promises

    def learn_cost(self, per_request: Amounts) -> None:
        """EWMA of one request's cost (the shares' targets are at least two of them)."""
        self.mean_cost = Amounts(*(0.9 * self.mean_cost.get(k) + 0.1 * per_request.get(k) for k in KINDS))


@dataclass
class TenantBook:
    """The scheduler's side: every budgeted tenant's bucket, the shares leases hold, the promises."""

    specs: Mapping[str, TenantSpec]
    states: dict[str, TenantState] = field(default_factory=dict)
    last_taken: Promise | None = None  # the promise the last admitted check used (put back by refund)
    _given: dict[str, OrderedDict[str, None]] = field(default_factory=dict)  # lease → give-backs applied

    def state(self, tenant: str, now: float) -> TenantState | None:
        st = self.states.get(tenant)
        if st is None:
            spec = self.specs.get(tenant)
            if spec is None or not spec.budgeted():
                return None
            full = Amounts(*(spec.limit(k) or 0.0 for k in RATE_KINDS))
            st = self.states[tenant] = TenantState(spec, full, now)
        st.refill(now)
        return st

    def check(self, tenant: str, cost: Amounts, now: float, *, fingerprint: str = "", reserves: bool = False
              ) -> BudgetRefusal | None:
        """None: the budget covers ``cost`` (taken); else the refusal, with a promise for a client
        that retries (``reserves``, recognised again by ``fingerprint``).  A request queues behind
        every promise but its own."""
        st = self.state(tenant, now)
        if st is None:
            return None
        promises = st.live_promises(now)
        mine = promises.by_id.get(fingerprint) if fingerprint else None
        if mine is not None and mine.due > now + EARLY_S:  # back before its time: it keeps its place
            left = st.remaining() - promises.total
            return BudgetRefusal(tenant, lacking(left, cost, st.spec) or ("requests",), mine.due - now,
                                 ratelimit_headers(st.spec, left))
        ahead = promises.ahead_of(mine, now)
        have = st.available() - ahead
        self.last_taken = None
        if not lacking(have, cost, st.spec):
            if mine is not None:
                promises.take(mine)
                self.last_taken = mine
            self._take(st, cost)
            return None
        # timed on what the scheduler holds itself: shares leases hold may be spent before they
        # learn of this refusal (those given back only make later requests fit sooner)
        out = refusal(st.spec, have, cost, st.slot_wait_s(), shown=st.remaining() - ahead)
        ra = out.retry_after_s
        if mine is not None:  # early: it keeps its place, for the rest of its wait
            if ra is not None:
                mine.until = max(mine.until, now + ra + PROMISE_GRACE_S)
        elif (reserves and fingerprint and ra is not None and "concurrent" not in out.kinds
              and ra <= PROMISE_HORIZON_S and len(promises) < MAX_PROMISES):
            promises.add(Promise(fingerprint, now + ra, now + ra + PROMISE_GRACE_S,
                                 Amounts(cost.requests, cost.input_tokens)))
        return out

    def _take(self, st: TenantState, cost: Amounts) -> None:
        cost = limited(cost, st.spec)
        st.level = st.level - cost.rates()
        st.in_use += int(cost.concurrent)
        st.learn_cost(cost)

    def refund(self, tenant: str, cost: Amounts, now: float, promise: Promise | None = None) -> None:
        """A request the scheduler took budget for that never ran (it expired in the queue, its
        client left, no engine): its requests and tokens go back, and its slot, and the promise
        it used (its client keeps its place)."""
        st = self.state(tenant, now)
        if st is not None:
            if promise is not None:
                st.promises.put_back(promise)
            cost = limited(cost, st.spec)
            st.level = st.level + cost.rates()
            st.in_use = max(0, st.in_use - int(cost.concurrent))

    def ended(self, tenant: str, now: float, *, output_tokens: float, duration_s: float | None, own: bool) -> None:
        """A request ended: an own one (admitted here) frees its slot and pays its remaining output
        tokens; any measured duration teaches the concurrency Retry-After."""
        st = self.state(tenant, now)
        if st is None:
            return
        if own:
            st.in_use = max(0, st.in_use - 1)
        self.charge_output(tenant, output_tokens, now)
        if duration_s is not None:
            st.duration_s = 0.8 * st.duration_s + 0.2 * duration_s

    def charge_output(self, tenant: str, tokens: float, now: float) -> None:
        st = self.state(tenant, now)
        if st is not None and tokens:
            st.level = st.level - Amounts(output_tokens=tokens)

    # -- leases ------------------------------------------------------------------------------
    def lease_report(self, lease: str, part: TenantPart, now: float, *, fresh: bool) -> None:
        """A lease's report: what it spent from its shares and gives back, its requests in flight.
        ``fresh``: the scheduler has no record of the lease (new, or forgotten): its shares are void."""
        for give_id, tenant, back in part.given:
            self.given_back(lease, tenant, back, not fresh, now, give_id)
        for tenant in part.seen:
            st = self.state(tenant, now)
            if st is not None:
                st.active[lease] = now
        for tenant, n in part.in_use.items():
            st = self.state(tenant, now)
            if st is not None:
                st.lease_in_use[lease] = n
        for tenant in {*part.spent, *part.returned}:
            st = self.state(tenant, now)
            if st is None:
                continue
            spent = part.spent.get(tenant, NOTHING)
            back = part.returned.get(tenant, NOTHING)
            if fresh:  # its shares were reserved under a record forgotten since: only a debt is owed
                st.level = st.level - Amounts(output_tokens=max(0.0, -back.output_tokens))
                st.held.pop(lease, None)
                continue
            st.held[lease] = st.held.get(lease, NOTHING) - spent - back
            st.level = st.level + back.rates()
            if spent.requests > 0:
                st.learn_cost(Amounts.of({k: spent.get(k) / spent.requests for k in KINDS}))

    def grant(self, lease: str, now: float, live_leases: int) -> tuple[dict[str, Amounts], dict[str, Amounts]]:
        """(granted, targets) for the tenants this lease saw lately: a share of each one's bucket,
        none while the tenant has promises outstanding (its requests go to the scheduler)."""
        granted: dict[str, Amounts] = {}
        targets: dict[str, Amounts] = {}
        for tenant, st in self.states.items():
            seen = st.active.get(lease)
            if seen is None:
                continue
            if now - seen > ACTIVE_S:
                del st.active[lease]
                targets[tenant] = NOTHING
                continue
            st.refill(now)
            if st.live_promises(now) or st.tight():
                targets[tenant] = NOTHING
                continue
            n = max(1, min(live_leases, len(st.active)))
            target = self._target(st, n)
            held = st.held.get(lease, NOTHING)
            avail = st.available()
            vals = {k: max(0.0, min(target.get(k) - held.get(k), avail.get(k))) for k in KINDS}
            vals["concurrent"] = float(math.floor(vals["concurrent"]))
            got = Amounts.of(vals)
            targets[tenant] = target
            if got.any():
                granted[tenant] = got
                st.held[lease] = held + got
                st.level = st.level - got.rates()
        return granted, targets

    @staticmethod
    def _target(st: TenantState, n: int) -> Amounts:
        vals = {}
        for kind in KINDS:
            cap = st.spec.limit(kind)
            if cap is None:
                vals[kind] = 0.0
            elif kind == "concurrent":
                vals[kind] = float(int(cap // (2 * n)))
            elif kind == "output_tokens" and st.level.output_tokens < 0:
                vals[kind] = 0.0  # in debt: shares come back until it is paid
            else:
                vals[kind] = min(cap / (2 * n), max(cap / 60.0 * SHARE_S, 2 * st.mean_cost.get(kind)))
        return Amounts.of(vals)

    def given_back(self, lease: str | None, tenant: str, back: Amounts, epoch_ok: bool, now: float,
                   give_id: str = "") -> None:
        """A lease's share handed back with an admission call (void under another record of it), or
        again with a report when that call failed: applied once per ``give_id``."""
        st = self.state(tenant, now)
        if st is None or lease is None or not back.any() or not epoch_ok or lease not in st.held:
            return
        if give_id:
            seen = self._given.setdefault(lease, OrderedDict())
            if give_id in seen:
                return
            seen[give_id] = None
            while len(seen) > 4096:
                seen.popitem(last=False)
        st.held[lease] = st.held[lease] - back
        st.level = st.level + back.rates()

    def forget_lease(self, lease: str) -> None:
        """A lease gone silent (its ingress died): its shares and requests in flight are dropped."""
        self._given.pop(lease, None)
        for st in self.states.values():
            st.held.pop(lease, None)
            st.lease_in_use.pop(lease, None)
            st.active.pop(lease, None)

    def remaining(self, now: float) -> dict[str, dict[str, float]]:
        """Per budgeted tenant, what is left of each of its budgets, router-wide (``/status``)."""
        out = {}
        for name, spec in self.specs.items():
            st = self.state(name, now)
            if st is not None:
                left = st.remaining()
                out[name] = {k: left.get(k) for k in KINDS if spec.limit(k) is not None}
        return out

    def facts(self, now: float) -> tuple[TenantFacts, ...]:
        out = []
        for name, st in self.states.items():
            st.refill(now)
            promises = st.live_promises(now)
            out.append(TenantFacts(name, st.remaining(), now, bool(promises), st.slot_wait_s(), st.tight(), promises.total))
        return tuple(out)
