"""The prompt alone is judged with the margin of an engine's errors when idle, not with that of all
its errors (prediction/ttft.py ``on_idle_engine``, admission/core.py ``_score``).

Found on `make run` (2026-12-07): after a burst of 200 streamed chats, the simulated unified
engine's margin, learned from the burst's errors, stood at 0.32 (0.12 before it), and every tiny
prompt with a 0.1 s target was refused ``prompt_exceeds_ttft_budget`` (``x-should-retry: false``)
on the idle fleet, whose engine answered such prompts in 15-25 ms: the margin adds
``margin · max(projection, 0.25 s)`` to the prompt alone.  Refusals teach nothing, so with such
clients only it stayed so for good.  The test failed before the change for that reason."""

from __future__ import annotations

from dataclasses import replace

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.scheduler.service import SchedulerService
from tests.unit.admission.test_overload_decisions import engine, placed, refused, view

NOW = 1000.0


def one_engine_service() -> tuple[SchedulerService, EngineState]:
    """A predictive scheduler over one healthy engine "u", at NOW."""
    cfg = NarwhalConfig.model_validate({"admission": {"mode": "predictive"},
                                        "engines": [{"name": "u", "url": "http://127.0.0.1:1"}]})
    svc = SchedulerService(cfg, clock=lambda: NOW)
    e = svc.engines["u"]
    e.healthy, e.last_ok = True, NOW
    svc.router.started = True
    return svc, e


def test_a_burst_s_errors_leave_the_idle_engine_s_judgement_alone() -> None:
    svc, e = one_engine_service()

    def serve(decoding: int, ttft: float) -> Placement:
        e.inflight = decoding  # (requests past their first token: none pending prefill)
        p = decide(svc.view(NOW), Ask(prompt_tokens=20, ttft_budget_s=2.0), NOW, 0)
        assert isinstance(p, Placement) and p.predicted_s is not None, p
        e.inflight = 0
        learn_from(RelayStats("single", ("u",), ttft, 2, 0.01, 1), p, svc.engines, svc.histograms)
        return p

    for i in range(40):  # idle: 20-30 ms
        assert serve(0, 0.02 + 0.0025 * (i % 5)).idle
    for i in range(256):  # a burst: each prefilled beside 30 decoding, 30 ms, and one in 20 stalled to 0.4 s
        p = serve(30, 0.4 if i % 20 == 0 else 0.03)
        assert not p.idle and p.decoding == 30
    assert e.ttft_errors.margin == 1.0 and e.ttft_idle_errors.margin < 0.1, (e.ttft_errors, e.ttft_idle_errors)
    # idle again: a tiny prompt with a 0.1 s target (about 50 ms alone) is admitted; with all the
    # errors' margin it was 0.3 s as judged and refused for good
    p = decide(svc.view(NOW), Ask(prompt_tokens=20, ttft_budget_s=0.1), NOW, 0)
    assert isinstance(p, Placement), (p, e.ttft_model, e.ttft_idle_errors.margin)
    # loaded, it is refused with a Retry-After (waiting cures it), never told to shorten the prompt
    e.inflight = 30
    out = decide(svc.view(NOW), Ask(prompt_tokens=20, ttft_budget_s=0.1), NOW, 0)
    assert isinstance(out, Refusal) and out.error.code == "ttft_budget_exceeded" and out.error.retry_after, out


def test_an_idle_projection_and_the_prompt_alone_are_judged_alike() -> None:
    """On an idle engine the projection is the prompt alone, and both get the idle margin (no
    Retry-After loop: a refusal there is for good); with work ahead, the margin of all errors."""
    e = engine("u", ttft_a=0.02, ttft_b=0.002, ttft_margin=1.0, ttft_idle_margin=0.1)  # 0.62 s alone
    assert placed(view(e), Ask(300, 1.0, exact=True)).engines == ("u",)  # 0.682 s judged
    out = refused(view(e), Ask(300, 0.65, exact=True))
    assert out.error.code == "prompt_exceeds_ttft_budget" and out.error.retry_after is None
    ahead = replace(e, pending_prefill_tokens=10, pending_prefill_requests=1)  # 0.64 s projected, 1.28 judged
    out = refused(view(ahead), Ask(300, 1.0, exact=True))
    assert out.error.code == "ttft_budget_exceeded" and out.error.retry_after == 1
    decoding = replace(e, inflight=2)  # nothing ahead, two decoding beside it: not idle
    assert refused(view(decoding), Ask(300, 1.0, exact=True)).error.code == "ttft_budget_exceeded"
    # facts without an idle margin (a holder built before it): the one margin for both, as before
    assert refused(view(replace(e, ttft_idle_margin=None)), Ask(300, 1.0, exact=True)).error.code \
        == "prompt_exceeds_ttft_budget"
