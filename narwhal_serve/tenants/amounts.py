"""A vector over a tenant's budget kinds, and the cost of one request in it."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("requests", "input_tokens", "output_tokens", "concurrent")  # Amounts' fields, in their order


@dataclass(frozen=True)
class Amounts:
    requests: float = 0.0
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    concurrent: float = 0.0

    def __add__(self, o: "Amounts") -> "Amounts":
        return Amounts(self.requests + o.requests, self.input_tokens + o.input_tokens,
                       self.output_tokens + o.output_tokens, self.concurrent + o.concurrent)

    def __sub__(self, o: "Amounts") -> "Amounts":
        return Amounts(self.requests - o.requests, self.input_tokens - o.input_tokens,
                       self.output_tokens - o.output_tokens, self.concurrent - o.concurrent)

    def get(self, kind: str) -> float:
        return float(getattr(self, kind))

    def rates(self) -> "Amounts":
        """The per-minute kinds only (a concurrent slot is not spent from a bucket)."""
        return Amounts(self.requests, self.input_tokens, self.output_tokens)

    def any(self) -> bool:
        return bool(self.requests or self.input_tokens or self.output_tokens or self.concurrent)

    @classmethod
    def of(cls, values: dict[str, float]) -> "Amounts":
        return cls(**{k: float(v) for k, v in values.items() if k in KINDS})


NOTHING = Amounts()


def request_cost(prompt_tokens: int) -> Amounts:
    """What admitting one request takes from its tenant's budget: one request, its prompt tokens and
    one concurrent slot. Output tokens are charged as they are identified, not up front."""
    return Amounts(requests=1.0, input_tokens=float(prompt_tokens), concurrent=1.0)
