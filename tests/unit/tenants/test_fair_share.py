"""Fair share on constructed data: measured shares against weights, idle shares lent (a tenant alone
is never over its share), and the decision rule that keeps the end of the TTFT budget for the
tenants within their share."""

from __future__ import annotations

import pytest

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.tenants.fair import OVER_SHARE_HEADROOM, WINDOW_S, FairShare
from tests.support.scheduler import scheduler_service


def test_a_tenant_alone_is_never_over_its_share() -> None:
    f = FairShare({"a": 1.0, "b": 1.0})
    for i in range(100):
        f.admitted("a", 1000, float(i))
    assert f.over(100.0) == frozenset()


def test_shares_follow_weights_and_old_work_fades() -> None:
    f = FairShare({"a": 1.0, "b": 3.0})
    f.admitted("a", 600, 0.0)
    f.admitted("b", 400, 0.0)
    shares = f.shares(0.0)
    assert shares["a"] == pytest.approx((0.6, 0.25)) and shares["b"] == pytest.approx((0.4, 0.75))
    assert f.over(0.0) == {"a"}
    f.admitted("b", 2000, 1.0)  # b catches up: a is within its share again
    assert f.over(1.0) == frozenset()
    assert f.shares(1.0 + 20 * WINDOW_S) == {}  # nothing admitted lately: nobody active


def test_a_tenant_over_its_share_keeps_the_end_of_the_budget_free() -> None:
    svc, clock = scheduler_service({"mode": "predictive", "ttft_budget_s": 2.0},
                                   tenants={"list": [{"name": "a"}, {"name": "b"}]})
    for e in svc.engines.values():  # about 1.6 s of prefill queued everywhere
        e.pending_prefill_tokens, e.pending_prefill_requests = 7600, 4
    svc.fair.admitted("a", 9000, clock())
    svc.fair.admitted("b", 1000, clock())
    view = svc.view(clock())
    assert view.over_share == {"a"}
    within = decide(view, Ask(200, 2.0, tenant="b"), clock(), 0)
    over = decide(view, Ask(200, 2.0, tenant="a"), clock(), 0)
    assert isinstance(within, Placement) and within.predicted_s is not None
    assert OVER_SHARE_HEADROOM * 2.0 < within.predicted_s <= 2.0
    assert isinstance(over, Refusal) and over.error.code == "ttft_budget_exceeded"
