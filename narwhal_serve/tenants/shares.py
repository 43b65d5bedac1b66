"""An ingress lease's side of per-tenant budgets (docs/contract.md, "Tenants"): its shares of the tenants'
buckets, carved out by the scheduler (:mod:`.book`) and spent locally, with no scheduler call per
request; what it spent and gives back rides with its reports."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from narwhal_serve.config import TenantSpec
from narwhal_serve.tenants.amounts import KINDS, NOTHING, Amounts
from narwhal_serve.tenants.messages import TenantFacts, TenantPart
from narwhal_serve.tenants.rules import BudgetRefusal, lacking, limited, refilled, refusal


def _bump(into: dict[str, Amounts], tenant: str, a: Amounts) -> None:
    into[tenant] = into.get(tenant, NOTHING) + a


def _refused_here(spec: TenantSpec, router: Amounts, cost: Amounts, slot_wait_s: float) -> BudgetRefusal | bool:
    """The lease's own refusal when the router's budget as last heard lacks a rate kind; False (ask
    the scheduler) when it covers the request, or lacks only a concurrent slot: slots free as
    requests end, which the facts heard do not show yet (a client sending its next request as its
    last one ended was refused here); the scheduler judges on the counts as they are."""
    kinds = lacking(router, cost, spec)
    return refusal(spec, router, cost, slot_wait_s) if kinds and kinds != ("concurrent",) else False


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
        if f is not None and f.pressed:  # promises out: the scheduler keeps their order
            if retry or reserves:
                return False
            est = refilled(spec, f.level, now - f.at) - f.promised  # a newcomer queues behind them all
            return _refused_here(spec, est, cost, f.slot_wait_s)
        have = self.held.get(tenant, NOTHING)
        # the router-wide budget as last heard (this lease's share included), refilled only where
        # it is read (a refill never lowers a level: a positive output level heard stays positive)
        router = None
        if f is not None and spec.output_tokens_per_minute is not None and f.level.output_tokens <= 0:
            router = refilled(spec, f.level, now - f.at)
            if router.output_tokens <= 0:
                # in debt router-wide (another lease's streams): this share does not pay it
                have = replace(have, output_tokens=min(have.output_tokens, router.output_tokens))
        if not lacking(have, cost, spec):
            return True
        if f is None or retry or reserves:
            return False
        if router is None:
            router = refilled(spec, f.level, now - f.at)
        return _refused_here(spec, router, cost, f.slot_wait_s)

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
        """The router's remaining budget for ``tenant`` as this lease last heard it, less what this
        lease spent since that it has not reported yet (headers)."""
        spec = self.budgeted(tenant)
        f = self.facts.get(tenant)
        if spec is None or f is None:
            return None
        return refilled(spec, f.level, now - f.at) - self._spent.get(tenant, NOTHING)

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
