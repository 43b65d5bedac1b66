"""Per-request results and what a run reports: percentiles, throughput, goodput, SLO attainment,
refusals and Retry-After accuracy.  Pure functions over :class:`RequestResult` lists.

Definitions (also in the JSON output under ``definitions``):

* **TTFT**: send → first chunk carrying text (streaming); the whole latency when not streaming.
* **TPOT**: ``(e2e - ttft) / (output_tokens - 1)``, i.e. excluding the first token (vLLM's
  definition); ``None`` with fewer than 2 tokens (counts as met).
* **ITL**: gaps between successive text chunks (pooled over requests for percentiles).
* **admitted**: got HTTP 200 response headers.  **refused**: 429 or 503 (any code).
* **good**: completed (200, stream ended cleanly) with ``ttft <= slo_ttft`` and ``tpot <= slo_tpot``;
  **goodput** = good / duration (vLLM ``bench serve --goodput``), counting good retries too (an
  admitted retry takes the place of a first try; ``goodput_rps_first_try`` leaves them out);
  **attainment** = good / admitted (first tries).
* **duration**: for open-loop runs the arrival window (so that goodput at low load equals the
  offered rate times attainment, whatever the length of the tail); for closed-loop runs the span
  first send → last finish.  ``span_s`` and ``goodput_rps_span`` (vLLM's definition: good / span,
  tail included) are reported too.
* **Retry-After accuracy**: (1) *retry sample*: a sample of refusals carrying Retry-After is sent
  again, once, after that many seconds; ``retries_admitted`` of ``retry_sample`` retries were
  admitted (``retry_success`` = their share, "retries admitted"; ``retries_refused``: refused
  again), ``retry_good`` = share that also met the SLO.  (2) *capacity gap*: for every such
  refusal, the observed time from the refusal until the next first-try request was admitted;
  reported as the median gap and the share of refusals whose Retry-After was >= the gap
  (``not_early``), and the median overstatement ``retry_after - gap``.
* **TTFT prediction error**: over admitted requests (first tries and retries) with a first token
  and an ``X-Narwhal-Predicted-TTFT`` header, ``|ttft - predicted| / ttft``: median ``err_p50`` (and
  p90); ``bias_p50`` = median ``(predicted - ttft) / ttft`` (< 0: the router under-predicts).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

REFUSAL_STATUSES = frozenset({429, 503})


@dataclass
class RequestResult:
    idx: int
    target: str
    sent: float  # seconds since the run start
    prompt_tokens: int
    max_tokens: int
    status: int = 0  # 0: no HTTP answer (connection error, timeout, cut at drain)
    ok: bool = False
    error_code: str | None = None
    retry_after: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    retry_of: int | None = None  # idx of the refused request this one retries
    predicted_ttft: float | None = None  # the router's X-Narwhal-Predicted-TTFT (seconds), if sent

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def admitted(self) -> bool:
        return self.status == 200

    @property
    def refused(self) -> bool:
        return self.status in REFUSAL_STATUSES

    @property
    def finished(self) -> float | None:
        return None if self.e2e is None else self.sent + self.e2e

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft is None or r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return tpot is None or tpot <= self.tpot_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; ``None`` if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist_ms(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max in milliseconds."""
    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000.0, 3)

    return {
        "n": len(values),
        "mean": ms(sum(values) / len(values)) if values else None,
        "p50": ms(percentile(values, 50)),
        "p90": ms(percentile(values, 90)),
        "p99": ms(percentile(values, 99)),
        "max": ms(max(values)) if values else None,
    }


def run_duration(results: Iterable[RequestResult]) -> float:
    """First send → last finish (seconds); 0 when nothing finished."""
    rs = list(results)
    ends = [r.finished for r in rs if r.finished is not None]
    if not rs or not ends:
        return 0.0
    return max(ends) - min(r.sent for r in rs)


def summarize(results: Sequence[RequestResult], slo: Slo, duration_s: float | None = None) -> dict[str, Any]:
    """The report of one run: first tries, except that good retries count towards goodput (retries
    are judged by :func:`retry_after_accuracy`)."""
    first = [r for r in results if r.retry_of is None]
    good_retries = sum(slo.met(r) for r in results if r.retry_of is not None)
    span = run_duration(first)
    dur = span if duration_s is None else duration_s
    ok = [r for r in first if r.ok]
    admitted = [r for r in first if r.admitted]
    refused = [r for r in first if r.refused]
    good = [r for r in first if slo.met(r)]
    failed = [r for r in first if not r.ok and not r.refused]
    per_s = (lambda n: n / dur) if dur > 0 else (lambda n: 0.0)
    n = len(first)
    return {
        "offered": n,
        "completed": len(ok),
        "admitted": len(admitted),
        "refused": len(refused),
        "failed": len(failed),
        "good": len(good),
        "duration_s": round(dur, 3),
        "span_s": round(span, 3),
        "goodput_rps_span": round(len(good) / span, 3) if span > 0 else 0.0,
        "arrived_rps": round(per_s(n), 3),
        "throughput_rps": round(per_s(len(ok)), 3),
        "output_tok_per_s": round(per_s(sum(r.output_tokens for r in ok)), 1),
        "goodput_rps": round(per_s(len(good) + good_retries), 3),
        "goodput_rps_first_try": round(per_s(len(good)), 3),
        "slo_attainment_admitted": round(len(good) / len(admitted), 4) if admitted else None,
        "refusal_rate": round(len(refused) / n, 4) if n else None,
        "status_counts": dict(Counter(str(r.status) for r in first)),
        "error_codes": dict(Counter(r.error_code for r in first if r.error_code)),
        "ttft_ms": dist_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": dist_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": dist_ms([g for r in ok for g in r.itl]),
        "e2e_ms": dist_ms([r.e2e for r in ok if r.e2e is not None]),
        "refusal_latency_ms": dist_ms([r.e2e for r in refused if r.e2e is not None]),
        "retry_after": retry_after_accuracy(results, slo),
        "ttft_prediction": ttft_prediction_error(results),
    }


def capacity_gaps(results: Sequence[RequestResult]) -> list[tuple[float, float]]:
    """(Retry-After, observed gap) per first-try refusal with Retry-After: the gap runs from the
    refusal's answer to the send time of the next first-try request that was admitted."""
    first = [r for r in results if r.retry_of is None]
    admitted_sends = sorted(r.sent for r in first if r.admitted)
    out: list[tuple[float, float]] = []
    for r in first:
        if not r.refused or r.retry_after is None or r.finished is None:
            continue
        i = bisect.bisect_left(admitted_sends, r.finished)
        if i < len(admitted_sends):
            out.append((r.retry_after, admitted_sends[i] - r.finished))
    return out


def retry_after_accuracy(results: Sequence[RequestResult], slo: Slo) -> dict[str, Any]:
    retries = [r for r in results if r.retry_of is not None]
    with_ra = [r for r in results if r.retry_of is None and r.refused and r.retry_after is not None]
    gaps = capacity_gaps(results)
    over = [ra - gap for ra, gap in gaps]
    return {
        "refusals_with_retry_after": len(with_ra),
        "retry_after_s": dist_s([r.retry_after for r in with_ra if r.retry_after is not None]),
        "retry_sample": len(retries),
        "retries_admitted": sum(r.admitted for r in retries),
        "retries_refused": sum(r.refused for r in retries),
        "retry_success": round(sum(r.admitted for r in retries) / len(retries), 4) if retries else None,
        "retry_good": round(sum(slo.met(r) for r in retries) / len(retries), 4) if retries else None,
        "gap_median_s": _round(percentile([g for _, g in gaps], 50)),
        "not_early": round(sum(ra >= g for ra, g in gaps) / len(gaps), 4) if gaps else None,
        "overstatement_median_s": _round(percentile(over, 50)),
    }


def ttft_prediction_error(results: Sequence[RequestResult]) -> dict[str, Any]:
    """How far the router's predicted TTFT was from the measured one (see the definitions)."""
    pairs = [(r.ttft, r.predicted_ttft) for r in results
             if r.admitted and r.ttft is not None and r.ttft > 0 and r.predicted_ttft is not None]
    err = [abs(t - p) / t for t, p in pairs]
    return {
        "n": len(pairs),
        "err_p50": _round(percentile(err, 50), 4),
        "err_p90": _round(percentile(err, 90), 4),
        "bias_p50": _round(percentile([(p - t) / t for t, p in pairs], 50), 4),
    }


def dist_s(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": _round(percentile(values, 50)), "max": _round(max(values)) if values else None}


def _round(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded, or ``None`` when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return round(a - b, 3)
