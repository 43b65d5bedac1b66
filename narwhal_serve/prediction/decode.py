"""The decode side of a prediction, learned from identified tokens: TPOT against the running batch,
output lengths, and what is left of a running request's decode.  Pure: no clock, no I/O.

**TPOT** per decode engine: ``tpot ≈ a + b · batch`` (``batch`` = sequences the engine runs, this
one included), least squares over the most recent measurements with a prior that fades — the same
scheme as the TTFT model (:mod:`.ttft`).  A measurement is one finished request's time per output
token after the first, from its identified tokens (vLLM's token IDs), against the batch it ran in.

**Output lengths** per route kind and ``max_tokens`` bucket (powers of two): a running mean of what
requests really generated (identified tokens), bounded memory (a handful of buckets per kind).  A
new request's expected decode work is that mean, never above its ``max_tokens``; before any
measurement, a prior (``min(max_tokens, DEFAULT_OUTPUT_PRIOR)``).

**Decode correction**: as a request's tokens arrive, its remaining decode is its expected length
less what it generated; a request that outgrew its expectation is expected to go on for a quarter
of what it has generated (at least one token), never past its ``max_tokens``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from narwhal_serve.prediction.ttft import Gram, fit_with_prior, refit_due

PRIOR_TPOT_A = 0.02  # seconds per token with one sequence running
PRIOR_TPOT_B = 0.0  # seconds per token per further sequence in the batch
PRIOR_BATCH_SPAN = 8.0  # the prior holds ``b`` as firmly as measurements spread over this many sequences
WINDOW = 256
DEFAULT_OUTPUT_PRIOR = 128.0  # expected output tokens before anything was learned (no max_tokens: this)
OUTPUT_ALPHA_FLOOR = 0.05  # the running mean forgets: at least this weight on each new length
MAX_BUCKET = 24  # max_tokens buckets 0 (unset), 1..24 (2^0 .. 2^23 and beyond)


@dataclass
class TpotModel:
    prior_a: float = PRIOR_TPOT_A
    prior_b: float = PRIOR_TPOT_B
    a: float = -1.0
    b: float = -1.0
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    unfit: int = field(default=0, repr=False, compare=False)  # samples since the last fit
    gram: Gram = field(default_factory=lambda: Gram(2), repr=False, compare=False)  # the samples' sums

    def __post_init__(self) -> None:
        if self.a < 0:
            self.a = self.prior_a
        if self.b < 0:
            self.b = self.prior_b

    def predict(self, batch: float) -> float:
        return tpot_at(self.a, self.b, batch)

    def observe(self, batch: float, tpot: float) -> None:
        self.gram.push(self.samples, (max(1.0, batch), max(0.0, tpot)))
        self.unfit += 1
        if not refit_due(len(self.samples), self.unfit):
            return
        self.unfit = 0
        sol = fit_with_prior(self.gram, ((self.prior_a, 1.0), (self.prior_b, PRIOR_BATCH_SPAN)), floors=(0.0, 0.0))
        self.a = max(0.0, float(sol[0]))
        self.b = max(0.0, float(sol[1]))


def tpot_at(a: float, b: float, batch: float) -> float:
    """:meth:`TpotModel.predict` from its coefficients (what crosses to ingress replicas)."""
    return a + b * max(1.0, batch)


def bucket(max_tokens: int | None) -> int:
    """0 for no ``max_tokens``; else 1 + floor(log2(max_tokens)), capped."""
    if not max_tokens or max_tokens <= 0:
        return 0
    return min(MAX_BUCKET, int(max_tokens).bit_length())


OutputKey = tuple[str, int]  # (route kind: "chat" | "completion", max_tokens bucket)


@dataclass
class OutputLengths:
    """Running mean of identified output lengths per (route kind, ``max_tokens`` bucket)."""

    prior: float = DEFAULT_OUTPUT_PRIOR
    means: dict[OutputKey, tuple[int, float]] = field(default_factory=dict)  # key → (count, mean)

    def observe(self, kind: str, max_tokens: int | None, output_tokens: int) -> None:
        key = (kind, bucket(max_tokens))
        n, mean = self.means.get(key, (0, 0.0))
        n += 1
        alpha = max(1.0 / n, OUTPUT_ALPHA_FLOOR)
        self.means[key] = (n, mean + alpha * (output_tokens - mean))

    def mean(self) -> float:
        """The mean output of the requests learned from, over every kind and bucket (else the
        prior): what a request whose own is unknown (another client's) is expected to write."""
        n = sum(c for c, _ in self.means.values())
        return sum(c * m for c, m in self.means.values()) / n if n else self.prior

    def table(self) -> tuple[tuple[str, int, float], ...]:
        """The learned means, as plain data for a fleet view."""
        return tuple((k, b, m) for (k, b), (_, m) in sorted(self.means.items()))


def expected_output(table: tuple[tuple[str, int, float], ...], kind: str, max_tokens: int | None,
                    prior: float = DEFAULT_OUTPUT_PRIOR, least: int = 0) -> float:
    """A new request's expected output tokens: the learned mean for its kind and bucket (else the
    prior), never above its ``max_tokens`` nor below ``least`` (what it writes at least: all of
    ``max_tokens`` with ``ignore_eos``), at least one."""
    b = bucket(max_tokens)
    mean = next((m for k, kb, m in table if k == kind and kb == b), None)
    if mean is None:
        mean = prior
    if max_tokens:
        mean = min(mean, float(max_tokens))
    return max(1.0, mean, float(least))


def mean_remaining(decode_tokens: float, inflight: int, otherwise: float) -> float:
    """Decode tokens still ahead per request of the router's at an engine (its ledger's mean),
    else ``otherwise`` (none there, or nothing left to decode)."""
    return decode_tokens / inflight if inflight > 0 and decode_tokens > 0 else otherwise


def remaining_tokens(expected: float, generated: float, max_tokens: int | None) -> float:
    """Decode tokens still ahead of a running request (the correction as its tokens arrive)."""
    left = expected - generated
    if left < 1.0:
        left = max(1.0, 0.25 * generated)
    if max_tokens:
        left = min(left, float(max(0, max_tokens - generated)))
    return max(0.0, left)
