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
