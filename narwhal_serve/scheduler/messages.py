"""Plain-data messages between ingress replicas and the scheduler (they cross the Ray hop)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from narwhal_serve.admission.controller import NONE, Permits
from narwhal_serve.admission.core import Ask
from narwhal_serve.admission.counters import CounterDelta
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.admission.wire import LeasePart
from narwhal_serve.errors import ErrorInfo
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.messages import HealthEvent
from narwhal_serve.tenants.amounts import Amounts


@dataclass(frozen=True)
class AdmitRequest:
    ticket_id: str
    request_deadline: float  # wall clock
    prompt_tokens: int
    max_output_tokens: int | None
    ttft_budget_s: float
    lease_id: str | None = None
    returned: Permits = NONE  # spare lease permits the ingress gives back before asking
    lease_epoch: int = 0  # the lease record those permits were reserved under
    tpot_budget_s: float | None = None
    kind: str = "chat"
    prefix: tuple[int, ...] = ()
    prefix_block_tokens: float = 0.0
    retry: bool = False
    reserves: bool = False
    tenant: str = ""
    tenant_returned: Amounts = Amounts()  # the lease's share of the tenant's budget, handed back
    fingerprint: str = ""
    rank: int = 0
    admit_within_s: float | None = None
    node: str | None = None
    min_output_tokens: int = 0
    exact: bool = False
    output_param: str = "max_tokens"
    truncate_to: int = 0
    waited_s: float = 0.0

    def ask(self) -> Ask:
        return Ask(self.prompt_tokens, self.ttft_budget_s, self.tpot_budget_s, self.kind, self.max_output_tokens,
                   self.prefix, self.prefix_block_tokens, self.retry, self.reserves, self.tenant, self.fingerprint,
                   self.rank, self.admit_within_s, self.node, self.min_output_tokens, self.exact, self.output_param,
                   self.truncate_to, self.waited_s)

    @classmethod
    def of(cls, ticket_id: str, request_deadline: float, ask: Ask, **lease: Any) -> "AdmitRequest":
        return cls(ticket_id, request_deadline, ask.prompt_tokens, ask.max_output_tokens, ask.ttft_budget_s,
                   tpot_budget_s=ask.tpot_budget_s, kind=ask.kind, prefix=ask.prefix,
                   prefix_block_tokens=ask.prefix_block_tokens, retry=ask.retry, reserves=ask.reserves,
                   tenant=ask.tenant, fingerprint=ask.fingerprint, rank=ask.rank,
                   admit_within_s=ask.admit_within_s, node=ask.node, min_output_tokens=ask.min_output_tokens,
                   exact=ask.exact, output_param=ask.output_param, truncate_to=ask.truncate_to,
                   waited_s=ask.waited_s, **lease)


@dataclass(frozen=True)
class AdmitResult:
    """Either ``candidates`` (admitted) or ``error`` (refused; the scheduler counted it)."""

    candidates: tuple[RouteChoice, ...] = ()
    error: ErrorInfo | None = None
    outcome: Outcome | None = None  # with ``error``: the terminal class the scheduler counted
    predicted_ttft_s: float | None = None  # with ``candidates``, in predictive mode
    epoch: int = 0  # with ``candidates``: the router lease's epoch they were placed under
    remaining: Amounts | None = None  # with ``candidates``: the tenant's remaining budget (rate-limit headers)


@dataclass
class Report:
    """What an ingress replica tells the scheduler since its last report."""

    counters: CounterDelta = field(default_factory=CounterDelta)
    decode_started: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # ticket, engines served
    released: list[tuple[str, RelayStats | None, bool]] = field(default_factory=list)  # (ticket, stats, completed)
    admission_waits: list[float] = field(default_factory=list)
    health: list[HealthEvent] = field(default_factory=list)  # attempts failed and first tokens, in order (breakers)
    progress: dict[str, int] = field(default_factory=dict)  # ticket → identified output tokens so far
    lease: LeasePart | None = None

    def empty(self) -> bool:
        return (self.counters.empty() and not self.decode_started and not self.released
                and not self.admission_waits and not self.health and not self.progress and self.lease is None)

    def absorb(self, later: "Report") -> None:
        """Append ``later``'s events to this report (order kept)."""
        self.counters.offered += later.counters.offered
        self.counters.unsized_offered += later.counters.unsized_offered
        self.counters.outcomes.update(later.counters.outcomes)
        self.counters.tenants.update(later.counters.tenants)
        self.counters.classes.update(later.counters.classes)
        self.counters.resumes.update(later.counters.resumes)
        self.decode_started.extend(later.decode_started)
        self.released.extend(later.released)
        self.admission_waits.extend(later.admission_waits)
        self.health.extend(later.health)
        self.progress.update(later.progress)
