"""What the scheduler learns from a finished request (pure: the state is passed in)."""

from __future__ import annotations

from collections.abc import Mapping

from narwhal_serve.admission.core import Placement
from narwhal_serve.config import PlacementConfig
from narwhal_serve.placement.drift import rel_error
from narwhal_serve.placement.engines import EngineState, FleetPrior, adopt_fleet_prior
from narwhal_serve.placement.prefix import CREDIT_EWMA, was_hit
from narwhal_serve.prediction.decode import OutputLengths
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.telemetry import Histogram, Tally


def learn_from(
    stats: RelayStats,
    p: Placement,
    engines: Mapping[str, EngineState],
    histograms: Mapping[str, Histogram],
    tally: Tally | None = None,
    completed: bool = True,
    outputs: OutputLengths | None = None,
    now: float = 0.0,
    placement: PlacementConfig | None = None,
    fleet_prior: FleetPrior | None = None,
) -> None:
    """What one finished request teaches: TTFT, TPOT and service-time models, drift, output lengths
    (a completed request's identified tokens), histograms, goodput (a completed request whose first
    token came within its target) and predicted-vs-measured TTFT (``tally``).  Models and drift learn
    only from a request served where it was placed, on its first attempt; nothing from a stream
    cut before its end (partial stats: no timings)."""
    if stats.partial:
        return
    as_placed = stats.attempts == 1 and stats.engines == p.engines and not stats.resumed_from
    pl = placement or PlacementConfig()
    # a resume's prefill is measured as a resume, never as a client TTFT
    for name, values in (("resume_gap", stats.resume_gap_s), ("resume_prefill", stats.resume_prefill_s),
                         ("resume_turnaround", stats.resume_turnaround_s)):
        if name in histograms:
            for v in values:
                histograms[name].observe(v)
    if stats.ttft_s is not None:
        client_ttft = stats.client_ttft_s
        assert client_ttft is not None
        histograms["ttft"].observe(client_ttft)
        if tally is not None and completed and p.ttft_budget_s is not None and client_ttft <= p.ttft_budget_s:
            tally.goodput += 1
        e = engines.get(p.first_engine or "")
        if e is not None and as_placed:
            d = engines.get(stats.engines[-1])
            if d is not None:
                dur = stats.ttft_s + stats.decode_s
                d.service_s = dur if d.service_s is None else 0.8 * d.service_s + 0.2 * dur
            if not p.slot_wait_s and not p.head_done and not e.drift.out:
                # (an engine out for drift is re-measured by its profiles alone: its requests placed
                # before it went out, finishing since, measured the slowness that took it out, and
                # taught to the model started again they kept it out for minutes)
                # the prefill model learns from a request that had a sequence slot at once (one that
                # waited measures mostly the error of its predicted wait, which would teach the prefill
                # model the line's length; one behind a head counted as partly prefilled, the error of
                # that estimate, which would teach it back to the model: a feedback that drove its
                # intercept to nothing), at the prefill work it really brought: with a prefix
                # credit, as a hit or as a miss, whichever the measurement is closer to (and the
                # engine's credit learns how often it was a hit)
                x = p.x_tokens
                if not e.ttft_model.samples:  # its first measurement: it starts from what the fleet measured
                    adopt_fleet_prior(e, engines.values(), fleet_prior)
                if p.matched_tokens:
                    x_hit, x_miss = x - (p.matched_tokens - p.cached_tokens), x + p.cached_tokens
                    hit = was_hit(stats.ttft_s, e.ttft_model.predict(x_hit, p.r_ahead),
                                  e.ttft_model.predict(x_miss, p.r_ahead))
                    x = x_hit if hit else x_miss
                    if not e.prefix_exact:  # an index fed by the engine's events is not an expectation
                        e.prefix_credit += CREDIT_EWMA * ((1.0 if hit else 0.0) - e.prefix_credit)
                e.ttft_model.observe(x, stats.ttft_s, p.r_ahead)
        if p.predicted_s is not None:
            histograms["ttft_prediction_error"].observe(abs(stats.ttft_s - p.predicted_s))
            if tally is not None:
                histograms["ttft_predicted"].observe(p.predicted_s)
                pair = tally.pair(p.first_engine or "")
                pair.n += 1
                pair.predicted_s += p.predicted_s
                pair.measured_s += stats.ttft_s
            if e is not None and as_placed and not e.drift.out:
                e.drift.observe_ttft(rel_error(stats.ttft_s, p.predicted_s, pl.drift_min_ttft_s), now)
                e.ttft_errors.observe(stats.ttft_s, p.predicted_s)
                if p.idle:  # (and those placed on it idle apart: the margin the prompt alone is judged with)
                    e.ttft_idle_errors.observe(stats.ttft_s, p.predicted_s)
    if stats.output_tokens > 1:
        tpot = stats.decode_s / (stats.output_tokens - 1)
        histograms["tpot"].observe(tpot)
        d = engines.get(stats.engines[-1])
        if d is not None:
            d.tpot_s = tpot if d.tpot_s is None else 0.8 * d.tpot_s + 0.2 * tpot
            if as_placed and p.decode_engine == stats.engines[-1] and not d.drift.out:  # (as for TTFT)
                if p.predicted_tpot_s is not None:
                    d.drift.observe_tpot(rel_error(tpot, p.predicted_tpot_s, pl.drift_min_tpot_s), now)
                d.tpot_model.observe(p.batch, tpot)
    if completed and outputs is not None and stats.output_tokens > 0:
        outputs.observe(p.kind, p.max_output_tokens, stats.output_tokens)
