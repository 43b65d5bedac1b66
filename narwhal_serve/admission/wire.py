"""What a lease and the scheduler tell each other across the Ray hop: the ingress's part of a
report (its placements, permits in use and given back) and the scheduler's grant (a fresh view and
more permits). The admission layer owns them: the lease (``lease.py``) reads and writes them, and the
scheduler's messages carry them."""

from __future__ import annotations

from dataclasses import dataclass, field

from narwhal_serve.admission.controller import NONE, Permits
from narwhal_serve.admission.core import FleetView, Placement
from narwhal_serve.admission.retry import Reservation
from narwhal_serve.admission.facts import ChangedRow, PrefixChange
from narwhal_serve.tenants.amounts import Amounts
from narwhal_serve.tenants.messages import TenantFacts, TenantPart


@dataclass(frozen=True)
class LocalPlacement:
    """A request an ingress admitted under its lease (the scheduler charges its engines)."""

    ticket_id: str
    placement: Placement
    deadline: float  # wall clock: past it (plus a grace) the scheduler forgets the ticket


@dataclass
class LeasePart:
    """A lease's share of one report."""

    lease_id: str
    generation: int
    epoch: int = 0  # the scheduler's record of the lease that ``returned`` was reserved under
    placed: list[LocalPlacement] = field(default_factory=list)
    returned: Permits = NONE
    in_use: Permits = NONE
    reserved: list[Reservation] = field(default_factory=list)  # room kept for refused clients' retries
    consumed: list[str] = field(default_factory=list)  # reservations retries took
    tenants: TenantPart | None = None  # budget shares spent and given back (tenants/)
    view_seq: int = 0  # the grant view the lease holds (0: none): the next grant may send changes only


@dataclass(frozen=True)
class LeaseGrant:
    """The scheduler's answer to a report: a fresh view and more permits for the lease."""

    lease_id: str
    generation: int  # of the report it answers
    view: FleetView
    sched_now: float  # the scheduler's wall clock when it granted
    ttl_s: float  # the lease holds this long after the report was cut (on the ingress's clock)
    granted: Permits  # added to the lease's spare permits
    spare_target: Permits  # spare beyond this goes back in the next report
    # The scheduler's record of this lease. A new epoch means a new record (the first grant, or the
    # scheduler forgot the lease — restart, or silent too long): it reserved exactly what the
    # answered report had in use, plus ``granted``; permits held from before are void.
    epoch: int = 0
    # tenants' budgets (tenants/): shares added to the lease's, its targets, the buckets
    tenant_granted: dict[str, Amounts] = field(default_factory=dict)
    tenant_targets: dict[str, Amounts] = field(default_factory=dict)
    tenant_facts: tuple[TenantFacts, ...] = ()
    # The view's number for this lease, and the one it is a delta of (0: whole). A delta carries
    # only the engines whose facts changed since that view (``rows``; its ``view.engines`` is
    # empty); ``names``: every engine, in the fleet's order, when those changed.
    view_seq: int = 0
    view_base: int = 0
    names: tuple[str, ...] = ()
    # A delta's rows come without prefix sets (pickling a set of a thousand block hashes costs
    # about 0.1 ms each side): these are the sets changed since that view, by engine, each as its
    # blocks added and removed where those are few (facts.prefix_change); an engine not in it keeps
    # the set it has (FleetView.merged)
    prefixes: dict[str, PrefixChange] | None = None
    # A delta's engines, as rows: each one's facts as plain values, with its config only where
    # the lease does not hold that one (EngineFacts.row: a thousand engines' facts and configs
    # pickled as dataclasses cost about 8 µs each, each side)
    rows: tuple[ChangedRow, ...] = ()
