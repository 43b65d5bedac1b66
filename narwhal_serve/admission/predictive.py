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
