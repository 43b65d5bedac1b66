"""``narwhal-bench goodput``: goodput and tail TTFT against offered load, up to ~2x SLO capacity.

1. **SLO capacity** ``C``: estimated from the simulator's timing model (Little's law with every
   engine slot busy: ``engines * max_num_seqs / E[prefill + (out-1) * tpot(full batch)]``) and
   measured by a calibration run: closed-loop clients straight at the engines, exactly one per
   engine slot, so nothing queues; ``C`` = ``clients / mean latency`` (Little's law, free of the
   window's ramp and tail) times the share of that run's requests that met the SLO.
   ``--capacity-rps`` skips both.
2. **sweep**: for each rate (fractions of ``C``, or ``--rates-rps``) one seeded arrival sequence and
   request set, sent to every target in rotated order; each run lasts ``duration_s`` plus at most
   ``drain_s`` (later answers are cut and count as failed).  Clients send ``X-TTFT-Target`` = the TTFT
   SLO (Narwhal's per-request budget; the engines ignore it).  A sample of refusals is retried once
   after their Retry-After (see ``stats`` for how Retry-After accuracy is defined).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from narwhal_serve.bench.client import RetryPolicy, Shape, make_session, run_closed_loop, run_open_loop
from narwhal_serve.bench.fleet import Fleet, SimTiming
from narwhal_serve.bench.progress import Progress
from narwhal_serve.bench.report import check
from narwhal_serve.bench.stats import RequestResult, Slo, ratio, summarize
from narwhal_serve.bench.workload import Api, Arrival, LengthDist, Workload, arrival_times

CHAT_TEMPLATE_TOKENS = 6  # the simulator's chat template around one user message


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
    retry_samples: int = 20
    api: Api = "chat"
    model: str = "narwhal-sim"
    stream: bool = True
    seed: int = 0


def model_capacity(timing: SimTiming, engines: int, wl: Workload, api: Api = "chat") -> float:
    """Requests per second the simulated fleet completes with every slot busy (no queueing)."""
    prompt = wl.prompt_len.mean() + (CHAT_TEMPLATE_TOKENS if api == "chat" else 1)
    service = timing.prefill_s(prompt) + max(0.0, wl.output_len.mean() - 1) * timing.tpot_s(timing.max_num_seqs)
    return engines * timing.max_num_seqs / service


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
                           extra_headers=(("X-TTFT-Target", f"{a.slo.ttft_s:g}"),))

    async def calibrate(self) -> dict[str, Any]:
        a, spec = self.a, self.fleet.spec
        est = model_capacity(spec.timing, spec.engines, a.workload, a.api) if self.fleet.simulated else None
        out: dict[str, Any] = {"model_rps": round(est, 3) if est else None}
        if a.capacity_rps:
            out.update(capacity_rps=a.capacity_rps, source="flag")
            return out
        conc = a.calib_concurrency or (spec.engines * spec.timing.max_num_seqs if self.fleet.simulated else 16)
        if a.calibrate_s <= 0 and est:
            out.update(capacity_rps=round(est, 3), source="model")
            return out
        specs = a.workload.specs([0.0] * 20_000, seed_offset=7)
        await asyncio.to_thread(self.fleet.settle)
        async with make_session() as session:
            with Progress(f"calibrate direct c={conc}") as prog:
                rs = await run_closed_loop(session, self.fleet.endpoints["direct"], self.shape, specs,
                                           concurrency=conc, duration_s=a.calibrate_s, drain_s=a.drain_s + 20,
                                           progress=prog)
        self.log.append(({"phase": "calibrate", "target": "direct", "concurrency": conc}, rs))
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
        specs = a.workload.specs(times, seed_offset=seed_offset)
        await asyncio.to_thread(self.fleet.settle)
        async with make_session() as session:
            with Progress(f"{label} {target} {rate:.2f} rps", total=len(specs)) as prog:
                rs = await run_open_loop(session, self.fleet.endpoints[target], self.shape, specs, drain_s=a.drain_s,
                                         retry=RetryPolicy(a.retry_samples, 0.25, a.seed + seed_offset),
                                         progress=prog)
        self.log.append(({"phase": label, "target": target, "rate_rps": rate}, rs))
        return rs

    async def sweep(self, capacity: float) -> list[dict[str, Any]]:
        for t in self.targets:
            if t.startswith("narwhal") and self.a.warmup_s > 0:
                await self.open_run(t, "warmup", 0.3 * capacity, 999, duration_s=self.a.warmup_s)
        rows: list[dict[str, Any]] = []
        for i, (frac, rate) in enumerate(rate_plan(self.a, capacity)):
            k = i % len(self.targets)
            for t in self.targets[k:] + self.targets[:k]:
                rs = await self.open_run(t, "sweep", rate, 100 + i)
                s = summarize(rs, self.a.slo, duration_s=self.a.duration_s)
                rows.append({"target": t, "load": round(frac, 3), "offered_rps": round(rate, 3),
                             "goodput_vs_capacity": ratio(s["goodput_rps"], capacity), **s})
        return rows


def goodput_checks(rows: list[dict[str, Any]], capacity: float) -> list[dict[str, Any]]:
    by = {(r["target"], r["load"]): r for r in rows}
    loads = sorted({r["load"] for r in rows})
    out: list[dict[str, Any]] = []
    if not loads:
        return out
    top = loads[-1]
    near08 = min(loads, key=lambda x: abs(x - 0.8))
    pred, rr = by.get(("narwhal-predictive", top)), by.get(("rr", top))
    if pred is not None:
        out.append(check(f"predictive goodput / capacity at {top}x", ratio(pred["goodput_rps"], capacity), ">=", 0.9))
        if rr is not None:
            out.append(check(f"predictive goodput / rr at {top}x", ratio(pred["goodput_rps"], rr["goodput_rps"]),
                             ">=", 4.0))
        att = [by[("narwhal-predictive", x)]["slo_attainment_admitted"] for x in loads
               if ("narwhal-predictive", x) in by]
        worst = min((v for v in att if v is not None), default=None)
        out.append(check("predictive admitted within SLO (worst load)", worst, ">=", 0.99))
        low = by.get(("narwhal-predictive", near08))
        if low is not None:
            out.append(check(f"predictive refused at {near08}x", low["refusal_rate"], "<=", 0.01))
    return out


async def run_goodput(a: GoodputArgs, fleet: Fleet, targets: list[str]) -> dict[str, Any]:
    run = GoodputRun(a, fleet, targets)
    cal = await run.calibrate()
    capacity = float(cal["capacity_rps"] or 0.0)
    if capacity <= 0:
        raise RuntimeError(f"could not estimate SLO capacity: {cal}")
    rows = await run.sweep(capacity)
    return {"capacity": cal, "rows": rows, "checks": goodput_checks(rows, capacity), "_log": run.log}
