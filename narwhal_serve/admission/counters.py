"""Global accounting: offered, unsized_offered and one terminal class per offered request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from narwhal_serve.protocol.outcomes import TERMINAL, Outcome


@dataclass
class Counters:
    offered: int = 0
    unsized_offered: int = 0
    by_outcome: Counter[tuple[str, str]] = field(default_factory=Counter)  # (outcome, reason) -> n
    by_tenant: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, outcome) -> n
    by_class: Counter[tuple[str, str]] = field(default_factory=Counter)  # (priority class, outcome) -> n
    resumes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (reason, outcome) -> mid-stream cuts

    def add(self, outcome: Outcome | str, reason: str = "", n: int = 1, tenant: str | None = None,
            klass: str | None = None) -> None:
        key = outcome.value if isinstance(outcome, Outcome) else outcome
        self.by_outcome[(key, reason)] += n
        if tenant is not None:
            self.by_tenant[(tenant, key)] += n
        if klass is not None:
            self.by_class[(klass, key)] += n

    def merge(self, delta: "CounterDelta") -> None:
        self.offered += delta.offered
        self.unsized_offered += delta.unsized_offered
        for (o, r), n in delta.outcomes.items():
            self.by_outcome[(o, r)] += n
        self.by_tenant.update(delta.tenants)
        self.by_class.update(delta.classes)
        self.resumes.update(delta.resumes)

    def total(self, outcome: Outcome) -> int:
        return sum(n for (o, _), n in self.by_outcome.items() if o == outcome.value)

    def contract_view(self) -> dict[str, int]:
        """The five contract counters under their contract names, plus the other terminal classes."""
        out = {"offered": self.offered, "unsized_offered": self.unsized_offered}
        for o in TERMINAL:
            out[o.value] = self.total(o)
        return out


def unbalanced(counters: Mapping[str, Any]) -> int:
    """``offered`` less the terminal classes, from a contract view (``/status`` ``counters``): 0 once
    every offered request has ended exactly once (the one "counters balance" check)."""
    return int(counters.get("offered", 0)) - sum(int(counters.get(o.value, 0)) for o in TERMINAL)


@dataclass
class CounterDelta:
    """Increments gathered by one ingress replica between two reports."""

    offered: int = 0
    unsized_offered: int = 0
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    tenants: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, outcome) -> n
    classes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (priority class, outcome) -> n
    resumes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (reason, outcome) -> mid-stream cuts

    def add(self, outcome: Outcome, reason: str = "", tenant: str | None = None, klass: str | None = None) -> None:
        self.outcomes[(outcome.value, reason)] += 1
        if tenant is not None:
            self.tenants[(tenant, outcome.value)] += 1
        if klass is not None:
            self.classes[(klass, outcome.value)] += 1

    def empty(self) -> bool:
        return not (self.offered or self.unsized_offered or self.outcomes or self.resumes)
