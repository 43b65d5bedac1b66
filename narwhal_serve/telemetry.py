"""Prometheus text for the scheduler's global view (SPEC §7): counters, gauges, histograms."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f'{name}_bucket{{le="{b}"}} {acc}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.n}")
        return lines


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_LABELLED = {"rejected", "refused", "invalid_requests", "expired", "failed", "cancelled"}
HISTOGRAM_HELP = {
    "ttft": ("narwhal_ttft_seconds", "Time to first token measured by the assembler."),
    "tpot": ("narwhal_tpot_seconds", "Time per output token after the first."),
    "admission_wait": ("narwhal_admission_wait_seconds", "Time from arrival to admission."),
    "ttft_prediction_error": (
        "narwhal_ttft_prediction_error_seconds",
        "Measured minus predicted TTFT (absolute value).",
    ),
}


def render_metrics(snap: dict[str, Any], histograms: dict[str, Histogram]) -> str:
    """Render a scheduler snapshot as Prometheus text."""
    c = snap["counters"]
    out: list[str] = []
    for key in ("offered", "unsized_offered", "completed"):
        out += [f"# TYPE narwhal_{key}_total counter", f"narwhal_{key}_total {c[key]}"]
    by_reason: dict[str, list[tuple[str, int]]] = {k: [] for k in _LABELLED}
    for row in snap["counters_by_reason"]:
        if row["outcome"] in by_reason:
            by_reason[row["outcome"]].append((row["reason"], row["count"]))
    for key in sorted(_LABELLED):
        out.append(f"# TYPE narwhal_{key}_total counter")
        for reason, n in by_reason[key]:
            out.append(f'narwhal_{key}_total{{reason="{_esc(reason)}"}} {n}')
    g = snap["gauges"]
    out += [
        "# TYPE narwhal_retained_requests gauge",
        f"narwhal_retained_requests {g['retained']}",
        "# TYPE narwhal_queued_requests gauge",
        f"narwhal_queued_requests {g['queued']}",
        "# TYPE narwhal_inflight_requests gauge",
        f'narwhal_inflight_requests{{phase="prefill"}} {g["prefill_inflight"]}',
        f'narwhal_inflight_requests{{phase="decode"}} {g["decode_inflight"]}',
        "# TYPE narwhal_ready gauge",
        f"narwhal_ready {1 if snap['ready'] else 0}",
        "# TYPE narwhal_engine_eligible gauge",
    ]
    for e in snap["engines"]:
        out.append(f'narwhal_engine_eligible{{engine="{_esc(e["name"])}",role="{e["role"]}"}} {int(e["eligible"])}')
    out.append("# TYPE narwhal_engine_tpot_seconds gauge")
    for e in snap["engines"]:
        if e.get("tpot_s") is not None:
            out.append(f'narwhal_engine_tpot_seconds{{engine="{_esc(e["name"])}"}} {e["tpot_s"]}')
    out.append("# TYPE narwhal_engine_drift_score gauge")
    for e in snap["engines"]:
        out.append(f'narwhal_engine_drift_score{{engine="{_esc(e["name"])}"}} {e.get("drift_score", 0.0)}')
    for key, (name, help_text) in HISTOGRAM_HELP.items():
        out += histograms[key].render(name, help_text)
    return "\n".join(out) + "\n"
