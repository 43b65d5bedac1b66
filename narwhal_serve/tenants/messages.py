"""What crosses the Ray hop about tenants' budgets: a lease's accounting in its report
(:class:`TenantPart`) and the scheduler's facts with each grant (:class:`TenantFacts`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from narwhal_serve.tenants.amounts import NOTHING, Amounts


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


@dataclass
class TenantPart:
    """A lease's tenant accounting in one report."""

    spent: dict[str, Amounts] = field(default_factory=dict)  # from its shares since the last cut
    returned: dict[str, Amounts] = field(default_factory=dict)  # shares given back (an output debt: negative)
    in_use: dict[str, int] = field(default_factory=dict)  # its requests in flight, per tenant
    seen: tuple[str, ...] = ()  # tenants it saw requests from since the last cut
    given: list[tuple[str, str, Amounts]] = field(default_factory=list)  # (id, tenant, share): admit calls that failed
