"""Plain-data messages between ingress replicas and the scheduler (they cross the Ray hop)."""

from __future__ import annotations

from dataclasses import dataclass, field

from narwhal_serve.admission.counters import CounterDelta
from narwhal_serve.errors import ErrorInfo
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.relay.messages import RelayStats


@dataclass(frozen=True)
class AdmitRequest:
    ticket_id: str
    request_deadline: float  # wall clock
    prompt_tokens: int
    max_output_tokens: int | None
    ttft_budget_s: float


@dataclass(frozen=True)
class AdmitResult:
    """Either ``candidates`` (admitted) or ``error`` (refused; the scheduler counted it)."""

    candidates: tuple[RouteChoice, ...] = ()
    error: ErrorInfo | None = None


@dataclass
class Report:
    """What an ingress replica tells the scheduler since its last report."""

    counters: CounterDelta = field(default_factory=CounterDelta)
    decode_started: list[str] = field(default_factory=list)
    released: list[tuple[str, RelayStats | None]] = field(default_factory=list)
    admission_waits: list[float] = field(default_factory=list)

    def empty(self) -> bool:
        return self.counters.empty() and not self.decode_started and not self.released and not self.admission_waits

    def absorb(self, later: "Report") -> None:
        """Append ``later``'s events to this report (order kept)."""
        self.counters.offered += later.counters.offered
        self.counters.unsized_offered += later.counters.unsized_offered
        self.counters.outcomes.update(later.counters.outcomes)
        self.decode_started.extend(later.decode_started)
        self.released.extend(later.released)
        self.admission_waits.extend(later.admission_waits)
