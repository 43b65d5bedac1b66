"""Fair share between tenants under overload (docs/contract.md, "Tenants").  Pure: ``now`` passed in.

Each tenant has a weight (``tenants.list[].weight``, 1 by default).  The scheduler measures the
prefill work each tenant was admitted lately: prompt tokens, decayed with a time constant of
``WINDOW_S``.  Among the tenants admitted anything in that window, a tenant's fair share is its
weight over their weights' sum; one whose measured share passes its fair share by ``SLACK`` is
*over its share*.

The rule (one copy, in :func:`narwhal_serve.admission.core.decide`): a request of a tenant over its
share is admitted only while its projected TTFT stays within ``OVER_SHARE_HEADROOM`` of its target.
On an idle fleet projections are far below targets and nothing changes (idle shares are lent:
a tenant alone is never over its share).  Under overload, the tenants within their share keep the
last part of the TTFT budget to themselves, so they are admitted before the tenant over it — until
the measured shares meet the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

WINDOW_S = 10.0  # time constant of the measured work
SLACK = 0.1  # a share this much (relative) above the fair one is "over"
OVER_SHARE_HEADROOM = 0.75  # a tenant over its share is admitted within this share of its TTFT target
MIN_WORK = 1.0  # decayed work below this is "not active"
RECOMPUTE_S = 0.05  # the over-share set is recomputed at most this often (the window is 10 s)


@dataclass
class FairShare:
    weights: Mapping[str, float]  # configured tenants (others weigh 1)
    work: dict[str, float] = field(default_factory=dict)  # decayed prompt tokens admitted
    at: float = 0.0
    _over: frozenset[str] = frozenset()
    _over_at: float = float("-inf")

    def _decay(self, now: float) -> None:
        if now <= self.at:
            return
        f = math.exp(-(now - self.at) / WINDOW_S)
        for t in list(self.work):
            self.work[t] *= f
            if self.work[t] < MIN_WORK / 100:
                del self.work[t]
        self.at = now

    def admitted(self, tenant: str, tokens: int, now: float) -> None:
        if not self.weights:  # no tenants configured: nothing to share
            return
        self._decay(now)
        self.work[tenant] = self.work.get(tenant, 0.0) + max(1, tokens)

    def shares(self, now: float) -> dict[str, tuple[float, float]]:
        """tenant → (measured share, fair share) for the active tenants."""
        self._decay(now)
        active = {t: w for t, w in self.work.items() if w >= MIN_WORK}
        total = sum(active.values())
        weights = {t: self.weights.get(t, 1.0) for t in active}
        wsum = sum(weights.values())
        if total <= 0 or wsum <= 0:
            return {}
        return {t: (active[t] / total, weights[t] / wsum) for t in active}

    def over(self, now: float) -> frozenset[str]:
        """The tenants over their fair share (none while fewer than two are active, or without
        tenants configured)."""
        if not self.weights:
            return frozenset()
        if 0.0 <= now - self._over_at < RECOMPUTE_S:
            return self._over
        self._over_at = now
        self._over = self._compute_over(now)
        return self._over

    def _compute_over(self, now: float) -> frozenset[str]:
        shares = self.shares(now)
        if len(shares) < 2:
            return frozenset()
        return frozenset(t for t, (u, f) in shares.items() if u > f * (1.0 + SLACK))
