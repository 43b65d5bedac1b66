"""What the scheduler learns from a finished request (pure: the state is passed in)."""

from __future__ import annotations

from collections.abc import Mapping

from narwhal_serve.admission.core import Placement
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.relay.messages import RelayStats
from narwhal_serve.telemetry import Histogram, Tally


def learn_from(
    stats: RelayStats,
    p: Placement,
    engines: Mapping[str, EngineState],
    histograms: Mapping[str, Histogram],
    tally: Tally | None = None,
    completed: bool = True,
) -> None:
    """What one finished request teaches: TTFT, TPOT and service-time models, drift, histograms,
    goodput (a completed request whose first token came within its target) and predicted-vs-measured
    TTFT (``tally``)."""
    if stats.ttft_s is not None:
        histograms["ttft"].observe(stats.ttft_s)
        if tally is not None and completed and p.ttft_budget_s is not None and stats.ttft_s <= p.ttft_budget_s:
            tally.goodput += 1
        e = engines.get(p.first_engine or "")
        if e is not None and stats.attempts == 1 and stats.engines == p.engines:
            # the prefill model learns the TTFT net of the predicted slot wait
            e.ttft_model.observe(p.x_tokens, max(0.0, stats.ttft_s - p.slot_wait_s), p.r_ahead)
            d = engines.get(stats.engines[-1])
            if d is not None:
                dur = stats.ttft_s + stats.decode_s
                d.service_s = dur if d.service_s is None else 0.8 * d.service_s + 0.2 * dur
        if p.predicted_s is not None:
            histograms["ttft_prediction_error"].observe(abs(stats.ttft_s - p.predicted_s))
            if tally is not None:
                histograms["ttft_predicted"].observe(p.predicted_s)
                pair = tally.pair(p.first_engine or "")
                pair.n += 1
                pair.predicted_s += p.predicted_s
                pair.measured_s += stats.ttft_s
            if e is not None:
                rel = (stats.ttft_s - p.predicted_s) / max(p.predicted_s, 1e-3)
                e.drift_score = 0.9 * e.drift_score + 0.1 * rel
    if stats.output_tokens > 1:
        tpot = stats.decode_s / (stats.output_tokens - 1)
        histograms["tpot"].observe(tpot)
        e = engines.get(stats.engines[-1])
        if e is not None:
            e.tpot_s = tpot if e.tpot_s is None else 0.8 * e.tpot_s + 0.2 * tpot
