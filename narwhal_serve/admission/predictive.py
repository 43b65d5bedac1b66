"""The contract's two predictive rows: prompt alone over budget, projected TTFT over budget."""

from __future__ import annotations

from dataclasses import replace

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.errors import NO_RETRY, RateLimited
from narwhal_serve.prediction.ttft import Projection


def _refused(message: str, code: str, wait_s: float | None = None) -> Refusal:
    """A predictive refusal (429); ``wait_s``: its honest Retry-After, rounded, at least 1 s; None:
    no wait cures it (``x-should-retry: false``)."""
    if wait_s is None:
        info = replace(RateLimited(message, code=code).info(), extra_headers=NO_RETRY)
    else:
        info = RateLimited(message, code=code, retry_after=max(1, round(wait_s))).info()
    return Refusal(info, Outcome.REFUSED)


def _s(seconds: float) -> str:
    """Seconds as a reader wants them: 0.25 s, 1.50 s, and 0.0004 s rather than 0.00 s."""
    return f"{seconds:.2f} s" if seconds >= 0.01 else f"{seconds:.2g} s"


def judge(p: Projection, budget_s: float, alone_budget_s: float | None = None, waited_s: float = 0.0
          ) -> Refusal | None:
    """None to admit; else the refusal with its honest Retry-After.  The prompt alone (on an idle
    engine, with the projection's error margin: the same judgement an idle engine gets, so no wait
    cures it) is judged against ``alone_budget_s`` (default ``budget_s``): the request's own budget
    where ``budget_s`` is narrowed for a while (a tenant over its fair share).  The projection is
    judged against ``budget_s`` less ``waited_s``, the time since the request reached the router
    (its first token is counted from there)."""
    alone_budget = budget_s if alone_budget_s is None else alone_budget_s
    judged = p.prompt_alone_s if p.judged_alone_s is None else p.judged_alone_s
    if judged > alone_budget:
        margin = "" if judged <= p.prompt_alone_s else f" ({_s(judged)} with this engine's prediction margin)"
        return _refused(f"The prompt alone needs about {_s(p.prompt_alone_s)}{margin} to first token, over the "
                        f"{_s(alone_budget)} TTFT budget: shorten the prompt or raise the target (X-TTFT-Target).",
                        "prompt_exceeds_ttft_budget")
    if p.projected_s > budget_s - waited_s:
        overrun = p.projected_s + waited_s - budget_s
        waited = f" less the {_s(waited_s)} it has waited since it reached the router" if waited_s >= 0.01 else ""
        # (a retry is a new request, received anew: what it waits for is the projection's own overrun)
        return _refused(f"Projected time to first token {_s(p.projected_s)} exceeds the {_s(budget_s)} budget"
                        f"{waited} by {_s(overrun)}; retry after the Retry-After delay.", "ttft_budget_exceeded",
                        max(0.0, p.projected_s - budget_s))
    return None


def judge_tpot(projected_s: float, budget_s: float, shed_s: float | None) -> Refusal:
    """Every route's projected TPOT with this request added is over the TPOT target: refused, so
    that admitted streams keep their speed.  ``shed_s``: about when the least loaded decode engine
    will have shed enough sequences (None: not even an idle engine meets it)."""
    if shed_s is None:
        return _refused(f"No engine is projected to generate faster than {projected_s * 1000:.1f} ms per output "
                        f"token, over the {budget_s * 1000:.3g} ms TPOT budget even as load drains: raise the "
                        f"target (X-TPOT-Target).", "tpot_budget_unattainable")
    return _refused(f"Projected time per output token {projected_s * 1000:.1f} ms exceeds the "
                    f"{budget_s * 1000:.3g} ms TPOT budget; retry after the Retry-After delay.",
                    "tpot_budget_exceeded", shed_s)
