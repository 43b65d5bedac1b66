"""Per-tenant budgets that hold for the whole router (README, "Tenants").  Pure: ``now`` passed in.

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
from collections.abc import Iterable, Mapping
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

from narwhal_serve.config import TenantSpec
from narwhal_serve.errors import ErrorInfo, RateLimited
from narwhal_serve.tenants.amounts import KINDS, NOTHING, Amounts

RATE_KINDS = ("requests", "input_tokens", "output_tokens")
PROMISE_GRACE_S = 2.0  # a promise whose client has not come back this long after its Retry-After lapses
PROMISE_HORIZON_S = 3600.0  # no promise is made further ahead than this (its Retry-After is still honest)
MAX_PROMISES = 100_000  # per tenant (about 10 MB at most)
SHARE_S = 1.0  # a lease's share covers about this long of the tenant's budget rate
EARLY_S = 0.05  # a promised retry this much early is told the rest of its wait
ACTIVE_S = 10.0  # a lease that has not seen a tenant this long gets no share of it
DURATION_PRIOR_S = 1.0  # a tenant's request duration before any was measured (concurrency Retry-After)


def lacking(have: Amounts, cost: Amounts, spec: TenantSpec) -> tuple[str, ...]:
    """The budget kinds that do not cover ``cost``: requests, input tokens and concurrent slots must
    cover it; output tokens must not be in debt (they are charged later, as generated)."""
    out = []
    for kind in KINDS:
        if spec.limit(kind) is None:
            continue
        if kind == "output_tokens":
            if have.output_tokens <= 0:
                out.append(kind)
        elif have.get(kind) < cost.get(kind):
            out.append(kind)
    return tuple(out)


def limited(a: Amounts, spec: TenantSpec) -> Amounts:
    """``a`` with the kinds the tenant has no budget of set to zero."""
    return Amounts.of({k: a.get(k) if spec.limit(k) is not None else 0.0 for k in KINDS})


def never_fits(cost: Amounts, spec: TenantSpec) -> str | None:
    """A kind whose whole per-minute budget is less than this one request (it can never be admitted)."""
    for kind in ("requests", "input_tokens", "concurrent"):
        cap = spec.limit(kind)
        if cap is not None and cost.get(kind) > cap:
            return kind
    return None


def wait_s(have: Amounts, cost: Amounts, kinds: Iterable[str], spec: TenantSpec, slot_wait_s: float) -> float:
    """How long until the lacking ``kinds`` have refilled enough for ``cost`` (rates of their
    limits); a concurrent slot: ``slot_wait_s``, the tenant's expected wait for one to free."""
    worst = 0.0
    for kind in kinds:
        if kind == "concurrent":
            worst = max(worst, slot_wait_s)
            continue
        cap = spec.limit(kind)
        assert cap is not None
        need = (cost.get(kind) if kind != "output_tokens" else 1.0) - have.get(kind)
        worst = max(worst, need / (cap / 60.0))
    return worst


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``6m0s``, ``1.5s``, ``20ms``."""
    if seconds < 1.0:
        return f"{max(0, int(math.ceil(seconds * 1000)))}ms"
    if seconds < 60.0:
        return f"{seconds:.3g}s"
    m, s = divmod(int(math.ceil(seconds)), 60)
    return f"{m}m{s}s"


_HEADER_KINDS = (("requests", "requests"), ("tokens", "input_tokens"), ("output-tokens", "output_tokens"))


def ratelimit_headers(spec: TenantSpec, remaining: Amounts) -> tuple[tuple[str, str], ...]:
    """OpenAI's ``x-ratelimit-limit-*``, ``-remaining-*`` and ``-reset-*`` (when the bucket is full
    again) for the tenant's budgeted kinds; ``tokens`` are input tokens, as OpenAI counts them up
    front, and ``output-tokens`` the output budget."""
    out: list[tuple[str, str]] = []
    for name, kind in _HEADER_KINDS:
        cap = spec.limit(kind)
        if cap is None:
            continue
        left = max(0.0, min(cap, remaining.get(kind)))
        out += [(f"x-ratelimit-limit-{name}", str(int(cap))), (f"x-ratelimit-remaining-{name}", str(int(left))),
                (f"x-ratelimit-reset-{name}", _duration((cap - left) / (cap / 60.0)))]
    return tuple(out)


@dataclass(frozen=True)
class BudgetRefusal:
    """A request over its tenant's budget: which kinds, and when it fits (None: it never does)."""

    tenant: str
    kinds: tuple[str, ...]
    retry_after_s: float | None
    headers: tuple[tuple[str, str], ...] = ()


_KIND_NAMES = {"requests": "requests per minute", "input_tokens": "input tokens per minute",
               "output_tokens": "output tokens per minute", "concurrent": "concurrent requests"}


def budget_error(r: BudgetRefusal) -> ErrorInfo:
    """The 429 ``rate_limit_exceeded`` of a refusal, with its rate-limit headers.  ``Retry-After``
    is rounded up to whole seconds; ``retry-after-ms`` (which the OpenAI SDKs read first) is exact.
    A request that can never fit says so, and ``x-should-retry: false`` stops the SDKs retrying."""
    what = " and ".join(_KIND_NAMES[k] for k in r.kinds)
    if r.retry_after_s is None:
        err = RateLimited(f"Request too large for tenant {r.tenant!r}: its budget of {what} is smaller than "
                          "this one request.", code="rate_limit_exceeded")
        return replace(err.info(), extra_headers=r.headers + (("x-should-retry", "false"),))
    ms = max(1, int(math.ceil(r.retry_after_s * 1000)))
    err = RateLimited(f"Rate limit reached for tenant {r.tenant!r} on {what}: this request fits in "
                      f"{ms / 1000:.3f} s (Retry-After).", code="rate_limit_exceeded",
                      retry_after=max(1, int(math.ceil(r.retry_after_s))))
    return replace(err.info(), extra_headers=r.headers + (("retry-after-ms", str(ms)),))


def refusal(spec: TenantSpec, have: Amounts, cost: Amounts, slot_wait_s: float,
            shown: Amounts | None = None) -> BudgetRefusal:
    """``cost`` refused against ``have``; its headers show ``shown`` (default ``have``)."""
    headers = ratelimit_headers(spec, have if shown is None else shown)
    big = never_fits(cost, spec)
    if big is not None:
        return BudgetRefusal(spec.name, (big,), None, headers)
    kinds = lacking(have, cost, spec)
    return BudgetRefusal(spec.name, kinds, wait_s(have, cost, kinds, spec, slot_wait_s), headers)


@dataclass(frozen=True)
class TenantFacts:
    """What a lease knows of a tenant's global budget (sent with each grant)."""

    name: str
    level: Amounts  # the router-wide remaining budget at ``at``: bucket and shares (concurrent: free slots)
    at: float  # the scheduler's wall clock
    pressed: bool  # promises outstanding: every request of this tenant goes to the scheduler
    slot_wait_s: float
    tight: bool = False  # the bucket is low: shares are coming back, requests beyond them go to the scheduler
    promised: Amounts = NOTHING  # what the promises outstanding hold

    def shifted(self, dt: float) -> "TenantFacts":
        return replace(self, at=self.at + dt)


def refilled(spec: TenantSpec, level: Amounts, dt: float, cap_less: Amounts = NOTHING) -> Amounts:
    """``level`` after ``dt`` seconds of refill, each rate kind capped at its limit less ``cap_less``
    (a level already above that cap is left as it is)."""
    vals = {}
    for kind in RATE_KINDS:
        cur = level.get(kind)
        cap = spec.limit(kind)
        if cap is None or dt <= 0:
            vals[kind] = cur
            continue
        vals[kind] = max(cur, min(cap - cap_less.get(kind), cur + dt * cap / 60.0))
    return Amounts(vals["requests"], vals["input_tokens"], vals["output_tokens"], level.concurrent)


@dataclass
class Promise:
    id: str  # the refused request's fingerprint
    due: float
    until: float
    cost: Amounts
    gone: bool = False


@dataclass
class Promises:
    """A tenant's promises in the order they were made, which is the order they fall due (each is
    made behind all the others).  Sums are kept, so a decision costs no walk over the queue."""

    queue: deque[Promise] = field(default_factory=deque)
    by_id: dict[str, Promise] = field(default_factory=dict)
    total: Amounts = NOTHING

    def __len__(self) -> int:
        return len(self.by_id)

    def expire(self, now: float) -> None:
        while self.queue and (self.queue[0].gone or self.queue[0].until < now):
            p = self.queue.popleft()
            if not p.gone:
                self.take(p)

    def take(self, p: Promise) -> None:
        """``p`` is used (or lapsed): its room is no longer kept (it leaves the deque lazily)."""
        p.gone = True
        self.by_id.pop(p.id, None)
        self.total = self.total - p.cost

    def ahead_of(self, mine: Promise | None, now: float) -> Amounts:
        """What is promised before ``mine`` and not yet due (all of it, for a request without a
        promise).  By the time a promise falls due the bucket holds it and every one before it, so
        an earlier one whose client is late (or never comes) does not hold up a client on time."""
        if mine is None:
            return self.total
        out = NOTHING
        for p in self.queue:  # (those before it still live: the few within their grace, or due)
            if p is mine:
                break
            if not p.gone and p.due > now:
                out = out + p.cost
        return out

    def add(self, p: Promise) -> None:
        self.queue.append(p)
        self.by_id[p.id] = p
        self.total = self.total + p.cost

    def put_back(self, p: Promise) -> None:
        """A promise taken by a request that was then refused for another reason."""
        if not p.gone or p.id in self.by_id:
            return
        p.gone = False
        i = next((k for k, q in enumerate(self.queue) if q.due > p.due), len(self.queue))
        self.queue.insert(i, p)
        self.by_id[p.id] = p
        self.total = self.total + p.cost


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
    def lease_report(self, lease: str, part: "TenantPart", now: float, *, fresh: bool) -> None:
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


@dataclass
class TenantPart:
    """A lease's tenant accounting in one report."""

    spent: dict[str, Amounts] = field(default_factory=dict)  # from its shares since the last cut
    returned: dict[str, Amounts] = field(default_factory=dict)  # shares given back (an output debt: negative)
    in_use: dict[str, int] = field(default_factory=dict)  # its requests in flight, per tenant
    seen: tuple[str, ...] = ()  # tenants it saw requests from since the last cut
    given: list[tuple[str, str, Amounts]] = field(default_factory=list)  # (id, tenant, share): admit calls that failed


def _bump(into: dict[str, Amounts], tenant: str, a: Amounts) -> None:
    into[tenant] = into.get(tenant, NOTHING) + a


@dataclass
class _Local:
    tenant: str
    output_charged: float = 0.0


@dataclass
class LeaseShares:
    """An ingress lease's side: its shares of the tenants' budgets, spent locally."""

    specs: Mapping[str, TenantSpec]
    held: dict[str, Amounts] = field(default_factory=dict)
    target: dict[str, Amounts] = field(default_factory=dict)
    facts: dict[str, TenantFacts] = field(default_factory=dict)
    in_use: dict[str, int] = field(default_factory=dict)
    tickets: dict[str, _Local] = field(default_factory=dict)
    _spent: dict[str, Amounts] = field(default_factory=dict)
    _returned: dict[str, Amounts] = field(default_factory=dict)
    _seen: set[str] = field(default_factory=set)
    _sent: dict[int, TenantPart] = field(default_factory=dict)
    _given: list[tuple[str, str, Amounts]] = field(default_factory=list)

    def budgeted(self, tenant: str) -> TenantSpec | None:
        spec = self.specs.get(tenant)
        return spec if spec is not None and spec.budgeted() else None

    def check(self, tenant: str, cost: Amounts, now: float, *, retry: bool, reserves: bool
              ) -> BudgetRefusal | bool:
        """True: the share covers it (take it with :meth:`take`); False: ask the scheduler; or a
        refusal, when even the whole router's bucket (as last heard) cannot cover it and the client
        is not one that gets a promise."""
        spec = self.budgeted(tenant)
        if spec is None:
            return True
        self._seen.add(tenant)
        f = self.facts.get(tenant)
        # the router-wide budget as last heard (this lease's share included)
        router = refilled(spec, f.level, now - f.at) if f is not None else None
        if f is not None and router is not None and f.pressed:  # promises out: the scheduler keeps their order
            if retry or reserves:
                return False
            est = router - f.promised  # a newcomer queues behind them all
            return refusal(spec, est, cost, f.slot_wait_s) if lacking(est, cost, spec) else False
        have = self.held.get(tenant, NOTHING)
        if router is not None and spec.output_tokens_per_minute is not None and router.output_tokens <= 0:
            # in debt router-wide (another lease's streams): this share does not pay it
            have = replace(have, output_tokens=min(have.output_tokens, router.output_tokens))
        if not lacking(have, cost, spec):
            return True
        if f is None or router is None or retry or reserves:
            return False
        return refusal(spec, router, cost, f.slot_wait_s) if lacking(router, cost, spec) else False

    def give_back(self, tenant: str) -> Amounts:
        """The lease's share of ``tenant``, handed back with an admission call to the scheduler
        (which then decides on all of it); an output debt stays, to be returned with the report."""
        have = self.held.get(tenant)
        if have is None:
            return NOTHING
        back = Amounts.of({k: max(0.0, have.get(k)) for k in KINDS})
        if back.any():
            self.held[tenant] = have - back
        return back

    def give_again(self, give_id: str, tenant: str, back: Amounts) -> None:
        """The admit call that carried ``back`` failed: it goes with the next report (the
        scheduler applies a give-back once, whichever way it came)."""
        if back.any():
            self._given.append((give_id, tenant, back))

    def take(self, ticket: str, tenant: str, cost: Amounts) -> None:
        spec = self.budgeted(tenant)
        if spec is None:
            return
        cost = limited(cost, spec)
        self.held[tenant] = self.held.get(tenant, NOTHING) - cost
        _bump(self._spent, tenant, cost)
        self.in_use[tenant] = self.in_use.get(tenant, 0) + 1
        self.tickets[ticket] = _Local(tenant)

    def remaining(self, tenant: str, now: float) -> Amounts | None:
        """The router's remaining budget for ``tenant`` as this lease last heard it (headers)."""
        spec = self.budgeted(tenant)
        f = self.facts.get(tenant)
        if spec is None or f is None:
            return None
        return refilled(spec, f.level, now - f.at)

    def progress(self, ticket: str, tokens: float) -> None:
        t = self.tickets.get(ticket)
        if t is not None and tokens > t.output_charged:
            more = Amounts(output_tokens=tokens - t.output_charged)
            t.output_charged = tokens
            self.held[t.tenant] = self.held.get(t.tenant, NOTHING) - more
            _bump(self._spent, t.tenant, more)

    def release(self, ticket: str, output_tokens: float | None) -> None:
        if output_tokens is not None:
            self.progress(ticket, output_tokens)
        t = self.tickets.pop(ticket, None)
        if t is None:
            return
        spec = self.budgeted(t.tenant)
        slot = Amounts(concurrent=1.0 if spec is not None and spec.max_concurrent is not None else 0.0)
        self.held[t.tenant] = self.held.get(t.tenant, NOTHING) + slot
        _bump(self._spent, t.tenant, NOTHING - slot)
        self.in_use[t.tenant] = max(0, self.in_use.get(t.tenant, 0) - 1)

    def cut(self, generation: int) -> TenantPart:
        """Shares beyond their targets go back (and an output debt, as a negative return)."""
        for tenant, have in list(self.held.items()):
            target = self.target.get(tenant, NOTHING)
            vals = {}
            for kind in KINDS:
                h = have.get(kind)
                vals[kind] = h - target.get(kind) if h > target.get(kind) else (h if kind == "output_tokens" and h < 0 else 0.0)
            back = Amounts.of(vals)
            if back.any():
                self.held[tenant] = have - back
                _bump(self._returned, tenant, back)
        # every count in flight here goes out (a zero once, after which it is dropped): a count the
        # scheduler kept from an older report would hold the tenant's slots
        part = TenantPart(self._spent, self._returned, dict(self.in_use), tuple(self._seen), self._given)
        for t in [t for t, n in self.in_use.items() if not n]:
            del self.in_use[t]
        self._given = []
        self._sent[generation] = part
        self._spent, self._returned, self._seen = {}, {}, set()
        return part

    def restore(self, generation: int) -> None:
        part = self._sent.pop(generation, None)
        if part is None:
            return
        for t, a in part.spent.items():
            _bump(self._spent, t, a)
        for t, a in part.returned.items():
            _bump(self._returned, t, a)
        self._seen |= set(part.seen)
        self._given = part.given + self._given

    def apply(self, generation: int, granted: Mapping[str, Amounts], targets: Mapping[str, Amounts],
              facts: Iterable[TenantFacts], *, new_record: bool, dt: float) -> None:
        """The answer to the report of ``generation``.  ``new_record``: the scheduler started a new
        record of this lease; the shares held before are void, and what was spent since that
        report (on void shares) becomes a debt to repay from the new ones."""
        later = [p for g, p in self._sent.items() if g > generation]
        for g in [g for g in self._sent if g <= generation]:
            del self._sent[g]
        if new_record:
            self.held = {}
            for part in (*later, TenantPart(self._spent)):
                for t, a in part.spent.items():
                    self.held[t] = self.held.get(t, NOTHING) - a.rates()
        for t, a in granted.items():
            self.held[t] = self.held.get(t, NOTHING) + a
        self.target = dict(targets)
        self.facts = {f.name: f.shifted(dt) for f in facts}
