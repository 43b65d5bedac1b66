"""The seed's two predictive rows: prompt alone over budget, projected TTFT over budget."""

from __future__ import annotations

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.admission.outcomes import Outcome
from narwhal_serve.errors import RateLimited
from narwhal_serve.prediction.ttft import Projection


def judge(p: Projection, budget_s: float) -> Refusal | None:
    """None to admit; else the refusal with its honest Retry-After."""
    if p.prompt_alone_s > budget_s:
        err = RateLimited(
            f"The prompt alone needs about {p.prompt_alone_s:.2f} s to first token, over the "
            f"{budget_s:.2f} s TTFT budget: shorten the prompt or raise the target (X-TTFT-Target).",
            code="prompt_exceeds_ttft_budget",
        )
        return Refusal(err.info(), Outcome.REFUSED)
    if p.projected_s > budget_s:
        overrun = p.projected_s - budget_s
        err = RateLimited(
            f"Projected time to first token {p.projected_s:.2f} s exceeds the {budget_s:.2f} s budget "
            f"by {overrun:.2f} s; retry after the Retry-After delay.",
            code="ttft_budget_exceeded",
            retry_after=max(1, round(overrun)),
        )
        return Refusal(err.info(), Outcome.REFUSED)
    return None


def judge_tpot(projected_s: float, budget_s: float, shed_s: float | None) -> Refusal:
    """Every route's projected TPOT with this request added is over the TPOT target: refused, so
    that admitted streams keep their speed.  ``shed_s``: about when the least loaded decode engine
    will have shed enough sequences (None: not even an idle engine meets it)."""
    if shed_s is None:
        err = RateLimited(
            f"No engine is projected to generate faster than {projected_s * 1000:.1f} ms per output token, "
            f"over the {budget_s * 1000:.1f} ms TPOT budget even as load drains: raise the target (X-TPOT-Target).",
            code="tpot_budget_unattainable",
        )
        return Refusal(err.info(), Outcome.REFUSED)
    err = RateLimited(
        f"Projected time per output token {projected_s * 1000:.1f} ms exceeds the {budget_s * 1000:.1f} ms TPOT "
        f"budget; retry after the Retry-After delay.",
        code="tpot_budget_exceeded",
        retry_after=max(1, round(shed_s)),
    )
    return Refusal(err.info(), Outcome.REFUSED)
