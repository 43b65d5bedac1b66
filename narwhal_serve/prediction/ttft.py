"""TTFT projection for predictive admission, fitted to measured data.

Model, per engine that serves the first token of a route:

    ttft ≈ w + a + b · x,   x = prompt tokens still waiting for prefill at that engine (router-known,
                                including this request's own prompt)
                            w = wait for a sequence slot at the engine that decodes (slot_wait_s)

``a`` is the fixed cost (scheduling, KV hand-off, first decode step), ``b`` seconds per prefill
token.  Fitted by least squares on the most recent measurements (x at admission, measured TTFT),
with a weak prior so that a fresh engine starts from sane values.  Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

PRIOR_A = 0.02  # seconds
PRIOR_B = 0.0002  # seconds per prompt token
PRIOR_WEIGHT = 4.0  # pseudo-observations of the prior with no data; it fades as samples arrive
PRIOR_FAR_X = 4096.0  # tokens
# How firmly the prior holds the slope: as firmly as measurements spread over about this many
# tokens would.  Measurements bunched at short prompts (a spread far below it) leave the slope near
# the prior, so noise never extrapolates wildly; measurements spread over a wider range than it
# decide the slope, whatever the engine's speed.
PRIOR_SLOPE_SPAN = 256.0
WINDOW = 256


@dataclass
class PrefillModel:
    prior_a: float = PRIOR_A
    prior_b: float = PRIOR_B
    a: float = -1.0  # set from the prior at construction
    b: float = -1.0
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def __post_init__(self) -> None:
        if self.a < 0:
            self.a = self.prior_a
        if self.b < 0:
            self.b = self.prior_b

    def predict(self, tokens_ahead_and_own: float) -> float:
        return linear_ttft(self.a, self.b, tokens_ahead_and_own)

    def observe(self, x: float, ttft: float) -> None:
        self.samples.append((x, ttft))
        self._fit()

    def _fit(self) -> None:
        xs = np.array([s[0] for s in self.samples], dtype=float)
        ys = np.array([s[1] for s in self.samples], dtype=float)
        # The prior as weighted pseudo-points at 0 (the intercept) and at a long prompt (the slope,
        # held as firmly as data spread over PRIOR_SLOPE_SPAN tokens would hold it).
        px = np.array([0.0, PRIOR_FAR_X])
        py = self.prior_a + self.prior_b * px
        prior_w = PRIOR_WEIGHT / (1.0 + len(xs) / 8.0)
        far_w = prior_w / 2 * (PRIOR_SLOPE_SPAN / PRIOR_FAR_X) ** 2
        w = np.concatenate([np.ones_like(xs), [prior_w / 2, far_w]])
        X = np.concatenate([xs, px])
        Y = np.concatenate([ys, py])
        sw = np.sqrt(w)
        A = np.stack([np.ones_like(X), X], axis=1) * sw[:, None]
        sol, *_ = np.linalg.lstsq(A, Y * sw, rcond=None)
        a, b = float(sol[0]), float(sol[1])
        self.a = max(0.0, a)
        self.b = max(1e-7, b)


@dataclass(frozen=True)
class Projection:
    prompt_alone_s: float  # the request on an idle engine
    projected_s: float  # with the prefill work already ahead of it


def slot_wait_s(in_flight: int, slots: int | None, service_s: float | None) -> float:
    """Expected wait for a free sequence slot at an engine that runs at most ``slots`` sequences:
    the requests beyond its slots (this one included) drain ``slots`` at a time, each taking about
    ``service_s`` (measured first byte to last token)."""
    if not slots or service_s is None:
        return 0.0
    excess = in_flight + 1 - slots
    return 0.0 if excess <= 0 else excess * service_s / slots


def project(model: PrefillModel, pending_tokens: float, prompt_tokens: int, wait_s: float = 0.0) -> Projection:
    """``wait_s``: queueing for a sequence slot ahead of the prefill (see :func:`slot_wait_s`)."""
    return project_linear(model.a, model.b, pending_tokens, prompt_tokens, wait_s)


def linear_ttft(a: float, b: float, tokens_ahead_and_own: float) -> float:
    """:meth:`PrefillModel.predict` from its two coefficients (what crosses to ingress replicas)."""
    return a + b * tokens_ahead_and_own


def project_linear(a: float, b: float, pending_tokens: float, prompt_tokens: int, wait_s: float = 0.0) -> Projection:
    """:func:`project` from a model's coefficients."""
    return Projection(
        prompt_alone_s=linear_ttft(a, b, prompt_tokens),
        projected_s=wait_s + linear_ttft(a, b, pending_tokens + prompt_tokens),
    )
