"""Prometheus text for the scheduler's global view (docs/operations.md, "Metrics"): counters, gauges, histograms."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from narwhal_serve.protocol.promtext import escape_label
from narwhal_serve.tenants.tally import render_classes, render_tenants
from narwhal_serve.protocol.outcomes import KNOWN_REASONS
from narwhal_serve.relay.messages import RESUME_OUTCOMES, RESUME_REASONS

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


_LABELLED = {"rejected", "refused", "invalid_requests", "expired", "failed", "cancelled"}
HISTOGRAM_HELP = {
    "ttft": ("narwhal_ttft_seconds", "Time to first token, from the request's receipt (HAProxy's stamp, else the ingress handler's start)."),
    "tpot": ("narwhal_tpot_seconds", "Time per output token after the first."),
    "admission_wait": ("narwhal_admission_wait_seconds", "Time from arrival to admission."),
    "ttft_prediction_error": (
        "narwhal_ttft_prediction_error_seconds",
        "Measured minus predicted TTFT (absolute value).",
    ),
    "resume_gap": (
        "narwhal_resume_gap_seconds",
        "Mid-stream resumes: the gap the client saw, from the last token before the cut to the first after it.",
    ),
    "resume_prefill": (
        "narwhal_resume_prefill_seconds",
        "Mid-stream resumes: from the continuation's request to its first token (its prefill).",
    ),
    "resume_turnaround": (
        "narwhal_resume_turnaround_seconds",
        "Mid-stream resumes: the router's turn-around, from the failure noticed to the continuation's request.",
    ),
    "ttft_predicted": (
        "narwhal_ttft_predicted_seconds",
        "TTFT predicted at admission, for requests whose TTFT was then measured.",
    ),
}

# Per-engine gauges (and a ``_total`` count, typed counter) from the scheduler's engine view:
# (metric, view key, help). A key whose value is None (not known yet) gives no sample for that engine.
ENGINE_GAUGES = (
    ("narwhal_engine_healthy", "healthy", "1 when the engine's /health and /metrics last answered."),
    ("narwhal_engine_metrics_age_seconds", "metrics_age_s", "Age of the engine's last good scrape."),
    ("narwhal_engine_inflight_requests", "inflight",
     "Requests the router routed to the engine and has not seen end."),
    ("narwhal_engine_running_requests", "running", "Requests the engine reported running (last scrape)."),
    ("narwhal_engine_waiting_requests", "waiting", "Requests the engine reported waiting (last scrape)."),
    ("narwhal_engine_kv_cache_usage_ratio", "kv_cache_usage", "KV-cache usage the engine reported, 0..1."),
    ("narwhal_engine_pending_prefill_tokens", "pending_prefill_tokens",
     "Prompt tokens routed to the engine and not yet past their first token."),
    ("narwhal_engine_pending_prefill_requests", "pending_prefill_requests",
     "Requests routed to the engine and not yet past their first token."),
    ("narwhal_engine_breaker_open", "breaker_open",
     "1 while the engine's circuit breaker is open or probing (no new work after failed attempts)."),
    ("narwhal_engine_consecutive_failures", "consecutive_failures",
     "Failed attempts on the engine since its last good first token."),
    ("narwhal_engine_backpressure_seconds", "backpressure_for_s",
     "Seconds left in the engine's backpressure window (after its 429/503), when one is open."),
    ("narwhal_engine_drift_out", "drift_out",
     "1 while the engine is out of rotation for drift, re-measured by profiling requests."),
    ("narwhal_engine_drift_outs_total", "drift_outs_total", "Times the engine went out of rotation for drift."),
    ("narwhal_engine_drift_ttft", "drift_ttft", "EWMA of the engine's (measured - predicted) / predicted TTFT."),
    ("narwhal_engine_drift_tpot", "drift_tpot", "EWMA of the engine's (measured - predicted) / predicted TPOT."),
    ("narwhal_engine_decode_tokens_ahead", "decode_tokens_ahead",
     "Decode tokens still expected from the router's requests at the engine (learned lengths, corrected as tokens arrive)."),
    ("narwhal_engine_prefix_index_blocks", "prefix_index_blocks",
     "Prompt-prefix blocks the router believes the engine holds (prefix-aware placement)."),
)

# the label values each per-engine counter has from the start, at zero
ENGINE_COUNTER_VALUES = {"faults_total": ("backpressure", "error", "timeout"), "probes_total": ("failed", "ok")}
# Per-engine counters kept as {label value: count} in the engine view: (metric, view key, label, help)
ENGINE_COUNTERS = (
    ("narwhal_engine_attempt_faults_total", "faults_total", "kind",
     "Failed attempts on the engine, by kind: error, timeout (silent), backpressure (429/503)."),
    ("narwhal_engine_probes_total", "probes_total", "result",
     "Probe requests the scheduler sent the engine while its breaker was open, by result."),
)


@dataclass
class TtftPair:
    """One engine's predicted and measured TTFT, summed over the same requests."""

    n: int = 0
    predicted_s: float = 0.0
    measured_s: float = 0.0


@dataclass
class Tally:
    """What the scheduler counts besides the terminal classes: admissions, goodput (first token
    within the request's TTFT target) and, per first-token engine, predicted vs measured TTFT."""

    admitted: int = 0
    goodput: int = 0
    prefix_hits: int = 0  # admissions placed where a prefix of their prompt was believed cached
    prefix_cached_tokens: int = 0  # the prompt tokens those placements credited as cached
    ttft_pairs: dict[str, TtftPair] = field(default_factory=dict)

    def pair(self, engine: str) -> TtftPair:
        return self.ttft_pairs.setdefault(engine, TtftPair())

    def view(self) -> dict[str, Any]:
        return {
            "admitted": self.admitted,
            "goodput": self.goodput,
            "prefix_hits": self.prefix_hits,
            "prefix_cached_tokens": self.prefix_cached_tokens,
            "ttft_by_engine": [
                {"engine": k, "n": p.n, "predicted_s_sum": p.predicted_s, "measured_s_sum": p.measured_s}
                for k, p in sorted(self.ttft_pairs.items())
            ],
        }


def _num(v: object) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def render_metrics(snap: dict[str, Any], histograms: dict[str, Histogram]) -> str:
    """Render a scheduler snapshot as Prometheus text."""
    c = snap["counters"]
    out: list[str] = []
    for key in ("offered", "unsized_offered", "completed"):
        out += [f"# TYPE narwhal_{key}_total counter", f"narwhal_{key}_total {c[key]}"]
    # every known reason from the start, at zero until it happens (KNOWN_REASONS)
    by_reason: dict[str, dict[str, int]] = {o.value: dict.fromkeys(KNOWN_REASONS[o], 0) for o in KNOWN_REASONS}
    for row in snap["counters_by_reason"]:
        if row["outcome"] in by_reason:
            by_reason[row["outcome"]][row["reason"]] = row["count"]
    for key in sorted(_LABELLED):
        out.append(f"# TYPE narwhal_{key}_total counter")
        for reason, n in sorted(by_reason[key].items()):
            out.append(f'narwhal_{key}_total{{reason="{escape_label(reason)}"}} {n}')
    out += _resumes(snap.get("resumes") or [])
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
        out.append(f'narwhal_engine_eligible{{engine="{escape_label(e["name"])}",role="{e["role"]}"}} {int(e["eligible"])}')
    out.append("# TYPE narwhal_engine_tpot_seconds gauge")
    for e in snap["engines"]:
        if e.get("tpot_s") is not None:
            out.append(f'narwhal_engine_tpot_seconds{{engine="{escape_label(e["name"])}"}} {e["tpot_s"]}')
    out.append("# TYPE narwhal_engine_drift_score gauge")
    for e in snap["engines"]:
        out.append(f'narwhal_engine_drift_score{{engine="{escape_label(e["name"])}"}} {e.get("drift_score", 0.0)}')
    for name, key, help_text in ENGINE_GAUGES:  # a count that only grows (``_total``) is a counter
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {'counter' if name.endswith('_total') else 'gauge'}"]
        for e in snap["engines"]:
            if e.get(key) is not None:
                out.append(f'{name}{{engine="{escape_label(e["name"])}"}} {_num(e[key])}')
    for name, key, label, help_text in ENGINE_COUNTERS:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        for e in snap["engines"]:
            for value, n in sorted({**dict.fromkeys(ENGINE_COUNTER_VALUES[key], 0), **(e.get(key) or {})}.items()):
                out.append(f'{name}{{engine="{escape_label(e["name"])}",{label}="{escape_label(value)}"}} {n}')
    out += _engine_info(snap["engines"])
    out += _served(snap.get("served"), [e["name"] for e in snap["engines"]])
    out += render_tenants(snap.get("tenants") or [])
    out += render_classes(snap.get("classes") or [])
    for key, (name, help_text) in HISTOGRAM_HELP.items():
        if key in histograms:
            out += histograms[key].render(name, help_text)
    return "\n".join(out) + "\n"


def _resumes(rows: list[dict[str, Any]]) -> list[str]:
    """Answers cut mid-stream, by what cut them and how each ended (every pair from the start, at zero)."""
    counts = {(r, o): 0 for r in RESUME_REASONS for o in RESUME_OUTCOMES}
    for row in rows:
        counts[(row["reason"], row["outcome"])] = row["count"]
    out = ["# HELP narwhal_resumes_total Answers cut after their first token (docs/contract.md, \"Engine failures (passive health)\"): "
           "reason is what cut them, outcome how each ended (resumed on another engine, or why not).",
           "# TYPE narwhal_resumes_total counter"]
    for (r, o), n in sorted(counts.items()):
        out.append(f'narwhal_resumes_total{{reason="{escape_label(r)}",outcome="{escape_label(o)}"}} {n}')
    return out


def _engine_info(engines: list[dict[str, Any]]) -> list[str]:
    """Where each engine runs (managed engines: node, replica, state) and managed restarts."""
    out = ["# HELP narwhal_engine_info 1 per engine; a managed engine's labels say where it runs and its state.",
           "# TYPE narwhal_engine_info gauge"]
    restarts = []
    for e in engines:
        p = e.get("placement") or {}
        labels = {"engine": e["name"], "managed": "true" if e.get("managed") else "false",
                  "state": p.get("state") or "", "node_id": p.get("node_id") or "",
                  "node_ip": p.get("node_ip") or "", "replica": p.get("replica") or ""}
        out.append("narwhal_engine_info{" + ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items()) + "} 1")
        if p:
            restarts.append(f'narwhal_engine_restarts_total{{engine="{escape_label(e["name"])}"}} {p.get("restarts", 0)}')
    out += ["# HELP narwhal_engine_restarts_total Replicas that replaced a managed engine's process.",
            "# TYPE narwhal_engine_restarts_total counter", *restarts]
    return out


def _served(served: dict[str, Any] | None, engines: list[str]) -> list[str]:
    """Admissions, goodput, and per-engine predicted vs measured TTFT (:meth:`Tally.view`)."""
    served = served or Tally().view()
    out = [
        "# HELP narwhal_admitted_total Requests admitted (placed on an engine route), by the scheduler or a lease.",
        "# TYPE narwhal_admitted_total counter",
        f"narwhal_admitted_total {served['admitted']}",
        ("# HELP narwhal_goodput_total Requests served with their first token within their TTFT target"
         " (X-TTFT-Target, else admission.ttft_budget_s)."),
        "# TYPE narwhal_goodput_total counter",
        f"narwhal_goodput_total {served['goodput']}",
        "# HELP narwhal_prefix_hits_total Admissions placed on an engine believed to hold a prefix of their prompt.",
        "# TYPE narwhal_prefix_hits_total counter",
        f"narwhal_prefix_hits_total {served.get('prefix_hits', 0)}",
        "# HELP narwhal_prefix_cached_tokens_total Prompt tokens those placements credited as cached.",
        "# TYPE narwhal_prefix_cached_tokens_total counter",
        f"narwhal_prefix_cached_tokens_total {served.get('prefix_cached_tokens', 0)}",
    ]
    rows = list(served["ttft_by_engine"])
    seen = {r["engine"] for r in rows}  # every engine from the start, at zero
    rows += [{"engine": e, "n": 0, "predicted_s_sum": 0.0, "measured_s_sum": 0.0} for e in engines if e not in seen]
    for name, key, help_text in (
        ("narwhal_engine_ttft_predictions_total", "n", "Requests with a predicted and a measured TTFT"),
        ("narwhal_engine_ttft_predicted_seconds_total", "predicted_s_sum", "Sum of those requests' predicted TTFT"),
        ("narwhal_engine_ttft_measured_seconds_total", "measured_s_sum", "Sum of those requests' measured TTFT"),
    ):
        out += [f"# HELP {name} {help_text}, by the engine predicted to give the first token.",
                f"# TYPE {name} counter"]
        out += [f'{name}{{engine="{escape_label(r["engine"])}"}} {r[key]}' for r in rows]
    return out
