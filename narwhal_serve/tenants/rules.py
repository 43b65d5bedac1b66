"""The budget rules, pure: what a tenant lacks for a request, how long until it fits, the 429 and
OpenAI's rate-limit headers, a bucket's refill (docs/contract.md, "Tenants").  Both sides of a lease use them:
the scheduler's buckets (:mod:`.book`) and an ingress lease's shares (:mod:`.shares`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from narwhal_serve.config import TenantSpec
from narwhal_serve.errors import NO_RETRY, ErrorInfo, RateLimited
from narwhal_serve.tenants.amounts import KINDS, NOTHING, Amounts

RATE_KINDS = ("requests", "input_tokens", "output_tokens")


def lacking(have: Amounts, cost: Amounts, spec: TenantSpec) -> tuple[str, ...]:
    """The budget kinds that do not cover ``cost``: requests, input tokens and concurrent slots must
    cover it; output tokens must not be in debt (they are charged later, as generated)."""
    out = []
    for kind in KINDS:
        if spec.limit(kind) is None:
            continue
        if kind == "output_tokens":
            if have.output_tokens <= 0:
                out.append(kind)
        elif have.get(kind) < cost.get(kind):
            out.append(kind)
    return tuple(out)


def limited(a: Amounts, spec: TenantSpec) -> Amounts:
    """``a`` with the kinds the tenant has no budget of set to zero."""
    return Amounts(*[a.get(k) if spec.limit(k) is not None else 0.0 for k in KINDS])  # (KINDS: Amounts' order)


def never_fits(cost: Amounts, spec: TenantSpec) -> str | None:
    """A kind whose whole per-minute budget is less than this one request (it can never be admitted)."""
    for kind in ("requests", "input_tokens", "concurrent"):
        cap = spec.limit(kind)
        if cap is not None and cost.get(kind) > cap:
            return kind
    return None


def wait_s(have: Amounts, cost: Amounts, kinds: Iterable[str], spec: TenantSpec, slot_wait_s: float) -> float:
    """How long until the lacking ``kinds`` have refilled enough for ``cost`` (rates of their
    limits); a concurrent slot: ``slot_wait_s``, the tenant's expected wait for one to free."""
    worst = 0.0
    for kind in kinds:
        if kind == "concurrent":
            worst = max(worst, slot_wait_s)
            continue
        cap = spec.limit(kind)
        assert cap is not None
        need = (cost.get(kind) if kind != "output_tokens" else 1.0) - have.get(kind)
        worst = max(worst, need / (cap / 60.0))
    return worst


def _duration(seconds: float) -> str:
    """OpenAI's reset format (a Go duration): ``6m0s``, ``1.5s``, ``20ms`` — rounded up to the
    millisecond (never earlier than it says; a float's 60.000000000001 s is a minute)."""
    ms = max(0, math.ceil(round(seconds * 1000.0, 6)))
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:g}s"
    m, rest = divmod(ms, 60_000)
    s = math.ceil(rest / 1000)
    if s == 60:
        m, s = m + 1, 0
    return f"{m}m{s}s"


def _kind_headers(name: str, cap: float, level: float) -> list[tuple[str, str]]:
    """One kind's three headers: ``level`` may be below 0 (output tokens spent past the budget: a
    debt), which the reset counts and the remaining does not show."""
    left = min(cap, level)
    return [(f"x-ratelimit-limit-{name}", str(int(cap))), (f"x-ratelimit-remaining-{name}", str(int(max(0.0, left)))),
            (f"x-ratelimit-reset-{name}", _duration((cap - left) * 60.0 / cap))]


def ratelimit_headers(spec: TenantSpec, remaining: Amounts) -> tuple[tuple[str, str], ...]:
    """OpenAI's ``x-ratelimit-limit-*``, ``-remaining-*`` and ``-reset-*`` (when the bucket is full
    again) for the tenant's budgeted kinds: ``requests``; ``tokens``, the tighter of its input and
    output budgets (the less left of its limit), the one clients read (LiteLLM keeps only these
    two); and each token budget under its own name, ``input-tokens`` and ``output-tokens``."""
    out: list[tuple[str, str]] = []
    if (cap := spec.limit("requests")) is not None:
        out += _kind_headers("requests", cap, remaining.get("requests"))
    tokens: list[tuple[float, float, str]] = []
    for kind in ("input_tokens", "output_tokens"):
        if (cap := spec.limit(kind)) is not None:
            tokens.append((cap, remaining.get(kind), kind))
    if tokens:
        cap, level, _ = min(tokens, key=lambda t: min(t[0], t[1]) / t[0])  # (a tie: the input budget)
        out += _kind_headers("tokens", cap, level)
        for cap, level, kind in tokens:
            out += _kind_headers(kind.replace("_", "-"), cap, level)
    return tuple(out)


@dataclass(frozen=True)
class BudgetRefusal:
    """A request over its tenant's budget: which kinds, and when it fits (None: it never does)."""

    tenant: str
    kinds: tuple[str, ...]
    retry_after_s: float | None
    headers: tuple[tuple[str, str], ...] = ()


_KIND_NAMES = {"requests": "requests per minute", "input_tokens": "input tokens per minute",
               "output_tokens": "output tokens per minute", "concurrent": "concurrent requests"}


def budget_error(r: BudgetRefusal) -> ErrorInfo:
    """The 429 ``rate_limit_exceeded`` of a refusal, with its rate-limit headers.  ``Retry-After``
    is rounded up to whole seconds; ``retry-after-ms`` (which the OpenAI SDKs read first) is exact.
    A request that can never fit says so, and ``x-should-retry: false`` stops the SDKs retrying."""
    what = " and ".join(_KIND_NAMES[k] for k in r.kinds)
    if r.retry_after_s is None:
        err = RateLimited(f"Request too large for tenant {r.tenant!r}: its budget of {what} is smaller than "
                          "this one request.", code="rate_limit_exceeded")
        return replace(err.info(), extra_headers=r.headers + NO_RETRY)
    ms = max(1, int(math.ceil(r.retry_after_s * 1000)))
    err = RateLimited(f"Rate limit reached for tenant {r.tenant!r} on {what}: this request fits in "
                      f"{ms / 1000:.3f} s (Retry-After).", code="rate_limit_exceeded",
                      retry_after=max(1, int(math.ceil(r.retry_after_s))))
    return replace(err.info(), extra_headers=r.headers + (("retry-after-ms", str(ms)),))


def refusal(spec: TenantSpec, have: Amounts, cost: Amounts, slot_wait_s: float,
            shown: Amounts | None = None) -> BudgetRefusal:
    """``cost`` refused against ``have``; its headers show ``shown`` (default ``have``)."""
    headers = ratelimit_headers(spec, have if shown is None else shown)
    big = never_fits(cost, spec)
    if big is not None:
        return BudgetRefusal(spec.name, (big,), None, headers)
    kinds = lacking(have, cost, spec)
    return BudgetRefusal(spec.name, kinds, wait_s(have, cost, kinds, spec, slot_wait_s), headers)


def refilled(spec: TenantSpec, level: Amounts, dt: float, cap_less: Amounts = NOTHING) -> Amounts:
    """``level`` after ``dt`` seconds of refill, each rate kind capped at its limit less ``cap_less``
    (a level already above that cap is left as it is)."""
    vals = {}
    for kind in RATE_KINDS:
        cur = level.get(kind)
        cap = spec.limit(kind)
        if cap is None or dt <= 0:
            vals[kind] = cur
            continue
        vals[kind] = max(cur, min(cap - cap_less.get(kind), cur + dt * cap / 60.0))
    return Amounts(vals["requests"], vals["input_tokens"], vals["output_tokens"], level.concurrent)
