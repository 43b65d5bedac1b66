"""``narwhal-bench goodput``: goodput and tail TTFT against offered load, up to ~2x SLO capacity.

1. **SLO capacity** ``C``: estimated from the simulator's timing model (Little's law with every
   engine slot busy: ``engines * max_num_seqs / E[prefill + (out-1) * tpot(full batch)]``) and
   measured by a calibration run: closed-loop clients straight at the engines, exactly one per
   engine slot, so nothing queues; ``C`` = ``clients / mean latency`` (Little's law, free of the
   window's ramp and tail) times the share of that run's requests that met the SLO.
   ``--capacity-rps`` skips both.
2. **sweep**: for each rate (fractions of ``C``, or ``--rates-rps``) one seeded arrival sequence and
   request set, sent to every target in rotated order; each run lasts ``duration_s`` plus at most
   ``drain_s`` (later answers are cut and count as failed).  Clients send ``X-TTFT-Target`` and
   ``X-TPOT-Target`` = the SLO (Narwhal's per-request budgets; the engines ignore them).  Refusals
   are retried once after their Retry-After, up to ``retry_samples`` per run spread over the window
   (see ``stats`` for how Retry-After accuracy and the TTFT prediction error are defined).

Several workloads (``lognormal``, ``shared-prefix``) run one after the other over the same fleet,
each with its own capacity.  Before every run the simulated engines are idle and their prefix
caches empty; for ``shared-prefix`` each engine's cache holds about ``ceil(K / engines) + 1`` of the
K group prefixes (:func:`sim_cache_blocks`), so only placement that keeps a group on one engine hits
it.  ``narwhal-prefix-blind`` runs on shared-prefix workloads only; the **prefix gain** is
narwhal-predictive's goodput / narwhal-prefix-blind's per load.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from narwhal_serve.bench.client import RetryPolicy, Shape, make_session, run_closed_loop, run_open_loop
from narwhal_serve.bench.fleet import Fleet, SimTiming
from narwhal_serve.bench.progress import Progress
from narwhal_serve.bench.report import check
from narwhal_serve.bench.stats import RequestResult, Slo, ratio, summarize
from narwhal_serve.bench.workload import (
    Api,
    Arrival,
    LengthDist,
    RequestSpec,
    Workload,
    arrival_times,
    oracle_hit_rate,
)
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim import render_chat

# the simulator's chat template around one user message, and the part of it before the message
# (<|im_start|> user \n; a completion has its BOS only), in the simulator's tokens
CHAT_TEMPLATE_TOKENS = len(render_chat([("user", "")]))
CHAT_LEAD_TOKENS = len(render_chat([("user", "")], add_generation_prompt=False)) - 2
SIM_DEFAULTS = SimEngineConfig()


def template_tokens(api: Api) -> int:
    """The simulator's tokens around one prompt: the chat template's, or a completion's BOS."""
    return CHAT_TEMPLATE_TOKENS if api == "chat" else 1


@dataclass
class GoodputArgs:
    slo: Slo = Slo(ttft_s=2.0, tpot_s=0.06)
    rates: list[float] = field(default_factory=lambda: [0.5, 0.8, 1.2, 2.0])
    rates_rps: list[float] | None = None
    duration_s: float = 10.0
    drain_s: float = 8.0
    arrival: Arrival = "poisson"
    burst_size: int = 8
    workload: Workload = Workload(LengthDist(256, 0.8, 16, 2048), LengthDist(24, 0.6, 4, 128))
    calibrate_s: float = 10.0
    calib_concurrency: int | None = None
    capacity_rps: float | None = None
    warmup_s: float = 4.0
    retry_samples: int = 1000
    retry_probability: float = 0.2
    num_gpu_blocks: int | None = None  # simulated engines' KV/prefix cache; None: sim_cache_blocks
    api: Api = "chat"
    model: str = "narwhal-sim"
    stream: bool = True
    seed: int = 0


def model_capacity(timing: SimTiming, engines: int, wl: Workload, api: Api = "chat",
                   cached_tokens: float = 0.0) -> float:
    """Requests per second the simulated fleet completes with every slot busy (no queueing);
    ``cached_tokens`` of every prompt found in the prefix cache.  The simulator prefills one request
    at a time (``prefill_mode: serial``), so an engine also completes at most 1 / prefill time."""
    prompt = wl.mean_prompt_tokens() + template_tokens(api) - cached_tokens
    service = timing.prefill_s(prompt) + max(0.0, wl.mean_output_tokens() - 1) * timing.tpot_s(timing.max_num_seqs)
    return engines * min(timing.max_num_seqs / service, 1.0 / timing.prefill_s(prompt))


def cached_prefix_tokens(wl: Workload, api: Api = "chat", block_size: int = SIM_DEFAULTS.kv_block_size) -> int:
    """Prompt tokens an engine that holds the group's prefix does not prefill (whole blocks)."""
    if not wl.prefix_groups:
        return 0
    lead = CHAT_LEAD_TOKENS if api == "chat" else 1
    return (lead + wl.prefix_tokens) // block_size * block_size


def oracle_prefix_hit_rate(wl: Workload, specs: list[RequestSpec], seed_offset: int, api: Api = "chat",
                           block_size: int = SIM_DEFAULTS.kv_block_size) -> float | None:
    """The prefix-cache hit rate an oracle placement gets on the requests of one run (every request
    on an engine that holds every prefix sent before it, an unbounded cache), in prompt tokens as
    the engines count them: for a trace, from its block ids (:func:`oracle_hit_rate`, the run's
    stretch of it); for a shared-prefix workload, every request but its group's first hits the
    group's whole prefix blocks.  ``None`` for a workload that shares no prefixes."""
    if wl.trace:
        return oracle_hit_rate(wl.trace_slice(len(specs), seed_offset)) if wl.trace[0].hash_ids else None
    if not wl.prefix_groups or not specs:
        return None
    cached, extra = cached_prefix_tokens(wl, api, block_size), template_tokens(api)
    seen: set[int | None] = set()
    hit = total = 0
    for s in specs:
        total += s.prompt_tokens + extra
        if s.group in seen:
            hit += cached
        seen.add(s.group)
    return hit / total if total else None


def sim_cache_blocks(wl: Workload, engines: int, api: Api = "chat",
                     block_size: int = SIM_DEFAULTS.kv_block_size) -> int:
    """Prefix-cache blocks per simulated engine: the simulator's default, or for a shared-prefix
    workload the blocks of ``ceil(K / engines) + 1`` whole prompts: room for the engine's share of
    the K prefixes and the suffixes passing through, not for all K (unless K is that small)."""
    if not wl.prefix_groups:
        return SIM_DEFAULTS.num_gpu_blocks
    prompt = wl.mean_prompt_tokens() + template_tokens(api)
    return (math.ceil(wl.prefix_groups / max(1, engines)) + 1) * math.ceil(prompt / block_size)


def engine_delta(before: list[tuple[float, float, float]],
                 after: list[tuple[float, float, float]]) -> dict[str, Any]:
    """What the simulated engines saw during one run: requests per engine and the prefix-cache hit
    rate (hit / queried prompt tokens, all engines)."""
    d = [tuple(y - x for x, y in zip(b, a)) for b, a in zip(before, after)]
    queried, hits = sum(e[1] for e in d), sum(e[2] for e in d)
    return {"requests": [int(e[0]) for e in d], "prefix_hit_rate": round(hits / queried, 4) if queried else None}


def rate_plan(a: GoodputArgs, capacity: float) -> list[tuple[float, float]]:
    """(fraction of capacity, requests per second) per sweep point."""
    if a.rates_rps:
        return [(r / capacity if capacity else 0.0, r) for r in a.rates_rps]
    return [(f, f * capacity) for f in a.rates]


class GoodputRun:
    def __init__(self, a: GoodputArgs, fleet: Fleet, targets: list[str]) -> None:
        self.a = a
        self.fleet = fleet
        self.targets = targets
        self.log: list[tuple[dict[str, Any], list[RequestResult]]] = []
        self.shape = Shape(api=a.api, model=a.model, stream=a.stream, timeout_s=a.duration_s + a.drain_s + 30,
                           extra_headers=(("X-TTFT-Target", f"{a.slo.ttft_s:g}"),
                                          ("X-TPOT-Target", f"{a.slo.tpot_s:g}")))
        self.cache_blocks = a.num_gpu_blocks or sim_cache_blocks(a.workload, fleet.spec.engines, a.api)
        self.engines_seen: dict[str, Any] = {}  # engine_delta of the last open_run
        self.specs_seen: list[RequestSpec] = []  # the requests of the last open_run

    async def _prepare(self) -> None:
        """Before a run: engines idle, prefix caches empty (and sized for this workload)."""
        await asyncio.to_thread(self.fleet.settle)
        await asyncio.to_thread(self.fleet.reset_caches, self.cache_blocks)

    def _log(self, tags: dict[str, Any], rs: list[RequestResult]) -> None:
        self.log.append(({**tags, "workload": self.a.workload.kind}, rs))

    async def calibrate(self) -> dict[str, Any]:
        a, spec = self.a, self.fleet.spec
        est = model_capacity(spec.timing, spec.engines, a.workload, a.api) if self.fleet.simulated else None
        out: dict[str, Any] = {"workload": a.workload.kind, "model_rps": round(est, 3) if est else None}
        if self.fleet.simulated and a.workload.prefix_groups:
            hot = model_capacity(spec.timing, spec.engines, a.workload, a.api, cached_prefix_tokens(a.workload, a.api))
            out.update(model_rps_prefix_cached=round(hot, 3), sim_cache_blocks=self.cache_blocks,
                       prefix_gain_ceiling=ratio(hot, est))
        if a.capacity_rps:
            out.update(capacity_rps=a.capacity_rps, source="flag")
            return out
        conc = a.calib_concurrency or (spec.engines * spec.timing.max_num_seqs if self.fleet.simulated else 16)
        if a.calibrate_s <= 0 and est:
            out.update(capacity_rps=round(est, 3), source="model")
            return out
        n_specs = 1_000 if a.workload.trace else 4_000 if a.workload.prefix_groups else 20_000
        specs = a.workload.specs([0.0] * n_specs, seed_offset=7)
        await self._prepare()
        async with make_session() as session:
            with Progress(f"calibrate direct c={conc}") as prog:
                rs = await run_closed_loop(session, self.fleet.endpoints["direct"], self.shape, specs,
                                           concurrency=conc, duration_s=a.calibrate_s, drain_s=a.drain_s + 20,
                                           progress=prog)
        self._log({"phase": "calibrate", "target": "direct", "concurrency": conc}, rs)
        s = summarize(rs, a.slo)
        # Little's law: each client always has one request in flight, so the fleet completes
        # conc / mean latency per second -- free of the ramp and tail of a short window.
        mean_e2e = (s["e2e_ms"]["mean"] or 0.0) / 1000.0
        thru = conc / mean_e2e if mean_e2e > 0 else 0.0
        attain = s["slo_attainment_admitted"] or 0.0
        out.update(capacity_rps=round(thru * attain, 3), throughput_rps=round(thru, 3), concurrency=conc,
                   source="calibration", slo_attainment=attain, window_throughput_rps=s["throughput_rps"],
                   ttft_p99_ms=s["ttft_ms"]["p99"], tpot_p99_ms=s["tpot_ms"]["p99"])
        return out

    async def open_run(self, target: str, label: str, rate: float, seed_offset: int,
                       duration_s: float | None = None) -> list[RequestResult]:
        a = self.a
        times = arrival_times(a.arrival, rate, a.duration_s if duration_s is None else duration_s,
                              np.random.default_rng([a.seed, seed_offset]), burst_size=a.burst_size)
        specs = self.specs_seen = a.workload.specs(times, seed_offset=seed_offset)
        await self._prepare()
        before = await asyncio.to_thread(self.fleet.sim_counters)
        async with make_session() as session:
            with Progress(f"{label} {target} {rate:.2f} rps", total=len(specs)) as prog:
                rs = await run_open_loop(session, self.fleet.endpoints[target], self.shape, specs, drain_s=a.drain_s,
                                         retry=RetryPolicy(a.retry_samples, a.retry_probability,
                                                           a.seed + seed_offset),
                                         progress=prog)
        self._log({"phase": label, "target": target, "rate_rps": rate}, rs)
        self.engines_seen = engine_delta(before, await asyncio.to_thread(self.fleet.sim_counters))
        return rs

    async def sweep(self, capacity: float) -> list[dict[str, Any]]:
        wl = self.a.workload
        targets = [t for t in self.targets if wl.prefix_groups or wl.trace or t != "narwhal-prefix-blind"]
        for t in targets:
            if t.startswith("narwhal") and self.a.warmup_s > 0:
                await self.open_run(t, "warmup", 0.3 * capacity, 999, duration_s=self.a.warmup_s)
        rows: list[dict[str, Any]] = []
        for i, (frac, rate) in enumerate(rate_plan(self.a, capacity)):
            k = i % len(targets)
            for t in targets[k:] + targets[:k]:
                rs = await self.open_run(t, "sweep", rate, 100 + i)
                s = summarize(rs, self.a.slo, duration_s=self.a.duration_s)
                oracle = {}  # the best hit rate any placement could get here
                if (o := oracle_prefix_hit_rate(wl, self.specs_seen, 100 + i, self.a.api)) is not None:
                    oracle = {"oracle_hit_rate": round(o, 4)}
                rows.append({"workload": wl.kind, "target": t, "load": round(frac, 3), "offered_rps": round(rate, 3),
                             "goodput_vs_capacity": ratio(s["goodput_rps"], capacity), **s,
                             "engines": self.engines_seen, **oracle})
        return rows


OVERLOAD = 1.5  # loads from this fraction of capacity up are checked as overload


def goodput_checks(rows: list[dict[str, Any]], capacity: float, label: str = "") -> list[dict[str, Any]]:
    """The benchmark targets of one workload's rows (check names start with ``label``)."""
    by = {(r["target"], r["load"]): r for r in rows}
    loads = sorted({r["load"] for r in rows})
    out: list[dict[str, Any]] = []
    if not loads:
        return out
    near08 = min(loads, key=lambda x: abs(x - 0.8))
    if any(t == "narwhal-predictive" for t, _ in by):  # (near08: the load nearest 0.8x, if within 0.2)
        for x in [x for x in loads if x >= OVERLOAD] or loads[-1:]:
            pred, rr = by.get(("narwhal-predictive", x)), by.get(("rr", x))
            if pred is None:
                continue
            out.append(check(f"{label}predictive goodput / capacity at {x}x", ratio(pred["goodput_rps"], capacity),
                             ">=", 0.9))
            if rr is not None:
                out.append(check(f"{label}predictive goodput / rr at {x}x",
                                 ratio(pred["goodput_rps"], rr["goodput_rps"]), ">=", 4.0))
        att = [by[("narwhal-predictive", x)]["slo_attainment_admitted"] for x in loads
               if ("narwhal-predictive", x) in by]
        worst = min((v for v in att if v is not None), default=None)
        out.append(check(f"{label}predictive admitted within SLO (worst load)", worst, ">=", 0.99))
        low = by.get(("narwhal-predictive", near08))
        if low is not None and abs(near08 - 0.8) <= 0.2:
            out.append(check(f"{label}predictive refused at {near08}x", low["refusal_rate"], "<=", 0.01))
    return out


PREFIX_WORKLOADS = ("shared-prefix", "mooncake")


def prefix_gain(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prefix-sharing workload and load: narwhal-predictive's goodput / narwhal-prefix-blind's,
    with the engines' cache hit rates and (for a trace) the oracle's."""
    by = {(r.get("workload"), r["target"], r["load"]): r for r in rows if r.get("workload") in PREFIX_WORKLOADS}
    out: list[dict[str, Any]] = []
    for wl, x in sorted({(w, load) for w, _, load in by}, key=lambda k: (str(k[0]), k[1])):
        aware, blind = by.get((wl, "narwhal-predictive", x)), by.get((wl, "narwhal-prefix-blind", x))
        if aware is not None and blind is not None:
            out.append({"workload": wl, "load": x, "predictive_goodput_rps": aware["goodput_rps"],
                        "blind_goodput_rps": blind["goodput_rps"],
                        "gain": ratio(aware["goodput_rps"], blind["goodput_rps"]),
                        "predictive_engines": aware.get("engines"), "blind_engines": blind.get("engines"),
                        "oracle_hit_rate": aware.get("oracle_hit_rate"),
                        "hits_vs_oracle": ratio((aware.get("engines") or {}).get("prefix_hit_rate"),
                                                aware.get("oracle_hit_rate"))})
    return out


def prefix_checks(gain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 19's prefix targets at every overload: prefix-aware goodput >= 2x prefix-blind's, and
    its engines' cache hit rate >= 0.9 of the oracle placement's."""
    out: list[dict[str, Any]] = []
    for g in gain:
        if g["load"] >= OVERLOAD:
            out.append(check(f"{g['workload']}: predictive goodput / prefix-blind at {g['load']}x", g["gain"],
                             ">=", 2.0))
            out.append(check(f"{g['workload']}: predictive cache hits / oracle at {g['load']}x",
                             g.get("hits_vs_oracle"), ">=", 0.9))
    return out


async def run_goodput(a: GoodputArgs, fleet: Fleet, targets: list[str]) -> dict[str, Any]:
    run = GoodputRun(a, fleet, targets)
    cal = await run.calibrate()
    capacity = float(cal["capacity_rps"] or 0.0)
    if capacity <= 0:
        raise RuntimeError(f"could not estimate SLO capacity: {cal}")
    rows = await run.sweep(capacity)
    label = "" if a.workload.kind == "lognormal" else f"{a.workload.kind}: "
    return {"capacity": cal, "rows": rows, "checks": goodput_checks(rows, capacity, label), "_log": run.log}


async def run_goodput_suite(runs: list[GoodputArgs], fleet: Fleet, targets: list[str]) -> dict[str, Any]:
    """:func:`run_goodput` per workload, one after the other over ``fleet``; merged results
    (``capacity``: the first workload's, ``capacities``: every workload's)."""
    parts = [await run_goodput(a, fleet, targets) for a in runs]
    rows = [r for p in parts for r in p["rows"]]
    gain = prefix_gain(rows)
    return {"capacity": parts[0]["capacity"], "capacities": [p["capacity"] for p in parts], "rows": rows,
            "prefix_gain": gain, "checks": [c for p in parts for c in p["checks"]] + prefix_checks(gain),
            "_log": [e for p in parts for e in p["_log"]]}
