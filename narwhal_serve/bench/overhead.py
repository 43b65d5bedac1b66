"""``narwhal-bench overhead``: what the router adds over the engine and over a bare proxy.

Against one fast simulated engine (no prefill cost, 1 ms per token, room for every request):

1. latency: closed-loop streaming clients at each concurrency (default 1, 8, 32); targets run in
   rotated order, ``rounds`` times, so machine noise hits all alike; TTFT p50/p99 and ITL p99, the
   difference to ``direct`` and the ratio to ``proxy``;
2. throughput: closed loop at each ``tput_concurrency`` (default 8 and 64), non-streaming, 4 tokens; req/s and
   CPU per request of each target's process tree (``/proc``), gross and net of its idle burn;
3. refusal path: ``narwhal-predictive`` with ``X-TTFT-Target: 0.001`` (every request refused with
   429 ``prompt_exceeds_ttft_budget``), at 8 clients in rotated rounds: refusals per second, their
   latency and CPU each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from narwhal_serve.bench import procs
from narwhal_serve.bench.client import Endpoint, Shape, make_session, run_closed_loop
from narwhal_serve.bench.fleet import Fleet
from narwhal_serve.bench.progress import Progress
from narwhal_serve.bench.report import check
from narwhal_serve.bench.stats import RequestResult, Slo, diff, ratio, summarize
from narwhal_serve.bench.workload import Api, LengthDist, RequestSpec, Workload

LOOSE_SLO = Slo(ttft_s=60.0, tpot_s=60.0)


@dataclass
class OverheadArgs:
    concurrencies: list[int] = field(default_factory=lambda: [1, 8, 32])
    phase_s: float = 3.0
    rounds: int = 2
    tput_concurrency: list[int] = field(default_factory=lambda: [8, 64])
    tput_s: float = 4.0
    refusal_s: float = 4.0
    idle_s: float = 3.0
    prompt_tokens: int = 64
    output_tokens: int = 16
    api: Api = "chat"
    model: str = "narwhal-sim"
    seed: int = 0
    distinct_prompts: int = 512  # the pool of prompts the clients cycle through
    unique_tail: bool = False  # each request's prompt ends with its own number (no two texts the same)


def _workload(a: OverheadArgs, out_tokens: int) -> Workload:
    p, o = a.prompt_tokens, out_tokens
    return Workload(LengthDist(p, 0.0, p, p), LengthDist(o, 0.0, o, o), seed=a.seed)


def _cpu_snapshot(fleet: Fleet, target: str) -> dict[int, tuple[str, float]]:
    m = fleet.process(target)
    if m is None:
        return {}
    return procs.tree_cpu(m.pid)


def _sim_cpu(fleet: Fleet) -> float:
    return sum(cpu for s in fleet.sims for _, cpu in procs.tree_cpu(s.pid).values())


class OverheadRun:
    def __init__(self, a: OverheadArgs, fleet: Fleet, targets: list[str]) -> None:
        self.a = a
        self.fleet = fleet
        self.targets = targets
        self.log: list[tuple[dict[str, Any], list[RequestResult]]] = []
        self._pools: dict[int, list[RequestSpec]] = {}
        self._tails = 0  # numbers given to prompts' tails so far (unique_tail)
        self._sent = 0  # prompts of the pool taken so far: each phase goes on where the last one stopped

    async def closed(self, target: str, label: str, concurrency: int, duration_s: float, stream: bool,
                     out_tokens: int, headers: tuple[tuple[str, str], ...] = (),
                     on_start: Callable[[], None] | None = None) -> list[RequestResult]:
        """``concurrency`` closed-loop clients at ``target`` for ``duration_s`` (``on_start``: called
        as the load begins, e.g. to stamp its wall time)."""
        ep: Endpoint = self.fleet.endpoints[target]
        n = min(20_000, max(100, int(concurrency * duration_s / 0.002)))
        pool = self._pools.get(out_tokens)
        if pool is None:  # distinct prompts, reused (the overhead fleet has no prefill cost)
            pool = self._pools[out_tokens] = _workload(self.a, out_tokens).closed_loop_specs(self.a.distinct_prompts)
        # (every target and round goes on through the pool, so with --distinct-prompts N no prompt
        # comes twice, to the router or to an engine, before N were sent)
        specs = [replace(pool[(self._sent + i) % len(pool)], idx=i) for i in range(n)]
        if self.a.unique_tail:  # the router's tokenization cache cannot answer them, an engine's prefix cache can
            base, self._tails = self._tails, self._tails + n
            specs = [replace(s, prompt=f"{s.prompt} {base + s.idx}") for s in specs]
        shape = Shape(api=self.a.api, model=self.a.model, stream=stream, timeout_s=30.0, extra_headers=headers)
        await asyncio.to_thread(self.fleet.settle)
        async with make_session() as session:
            with Progress(f"{label} {target} c={concurrency}") as prog:
                res = await run_closed_loop(session, ep, shape, specs, concurrency=concurrency,
                                            duration_s=duration_s, drain_s=10.0, progress=prog, on_start=on_start)
        self.log.append(({"phase": label, "target": target, "concurrency": concurrency}, res))
        self._sent += len(res)
        return res

    async def warmup(self) -> None:
        for t in self.targets:
            await self.closed(t, "warmup", 4, 1.5, True, self.a.output_tokens)

    async def latency(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for ci, c in enumerate(self.a.concurrencies):
            acc: dict[str, list[RequestResult]] = {t: [] for t in self.targets}
            for rnd in range(self.a.rounds):
                k = (ci + rnd) % len(self.targets)
                for t in self.targets[k:] + self.targets[:k]:
                    acc[t] += await self.closed(t, "latency", c, self.a.phase_s, True, self.a.output_tokens)
            out[str(c)] = {t: _latency_row(summarize(rs, LOOSE_SLO)) for t, rs in acc.items()}
            _add_deltas(out[str(c)])
        return out

    async def throughput(self) -> dict[str, Any]:
        idle = {t: await self._idle_rate(t) for t in self.targets}
        return {str(c): await self._throughput(c, idle) for c in self.a.tput_concurrency}

    async def _throughput(self, conc: int, idle: dict[str, float]) -> dict[str, Any]:
        a, out = self.a, dict[str, Any]()
        for rnd in range(a.rounds):
            k = rnd % len(self.targets)
            for t in self.targets[k:] + self.targets[:k]:
                before, sim0, lg0 = _cpu_snapshot(self.fleet, t), _sim_cpu(self.fleet), time.process_time()
                t0 = time.perf_counter()
                rs = await self.closed(t, "throughput", conc, a.tput_s, False, 4)
                wall = time.perf_counter() - t0
                spent = procs.cpu_delta(before, _cpu_snapshot(self.fleet, t))
                row = out.setdefault(t, {"completed": 0, "duration_s": 0.0, "cpu_s": 0.0, "idle_cpu_s": 0.0,
                                         "sim_cpu_s": 0.0, "loadgen_cpu_s": 0.0, "by_process_s": {}, "failed": 0})
                s = summarize(rs, LOOSE_SLO)
                row["completed"] += s["completed"]
                row["failed"] += s["failed"]
                row["duration_s"] += s["duration_s"]
                row["cpu_s"] += sum(spent.values())
                row["idle_cpu_s"] += idle[t] * wall
                row["sim_cpu_s"] += _sim_cpu(self.fleet) - sim0
                row["loadgen_cpu_s"] += time.process_time() - lg0
                for label, v in spent.items():
                    row["by_process_s"][label] = row["by_process_s"].get(label, 0.0) + v
        for t, row in out.items():
            n = max(1, row["completed"])
            row["req_per_s"] = round(row["completed"] / row["duration_s"], 1) if row["duration_s"] else None
            row["cpu_ms_per_req"] = round(1000 * row["cpu_s"] / n, 3) if row["cpu_s"] else None
            row["cpu_ms_per_req_net"] = (round(1000 * max(0.0, row["cpu_s"] - row["idle_cpu_s"]) / n, 3)
                                         if row["cpu_s"] else None)
            row["sim_cpu_ms_per_req"] = round(1000 * row["sim_cpu_s"] / n, 3)
            row["loadgen_cpu_ms_per_req"] = round(1000 * row["loadgen_cpu_s"] / n, 3)
            top = sorted(row["by_process_s"].items(), key=lambda kv: -kv[1])
            row["by_process_ms_per_req"] = {k: round(1000 * v / n, 3) for k, v in top if v > 0}
            del row["by_process_s"]
        for t, row in out.items():
            row["vs_proxy"] = ratio(row["req_per_s"], out.get("proxy", {}).get("req_per_s"))
            row["vs_direct"] = ratio(row["req_per_s"], out.get("direct", {}).get("req_per_s"))
        return out

    async def _idle_rate(self, target: str) -> float:
        """CPU seconds per second the target's process tree burns with no traffic."""
        before = _cpu_snapshot(self.fleet, target)
        if not before:
            return 0.0
        t0 = time.perf_counter()
        await asyncio.sleep(self.a.idle_s)
        spent = sum(procs.cpu_delta(before, _cpu_snapshot(self.fleet, target)).values())
        return spent / (time.perf_counter() - t0)

    async def refusals(self) -> dict[str, Any] | None:
        """The refusal path of narwhal-predictive, and of its ``@base`` when that runs too: each
        alone, ``--rounds`` times in turn (the order rotated each round, as the other phases), at
        the concurrency of the success path it is compared with (``REFUSAL_CONCURRENCY``)."""
        t = "narwhal-predictive"
        if t not in self.targets:
            return None
        builds = [t] + ([f"{t}@base"] if f"{t}@base" in self.targets else [])
        runs: dict[str, list[tuple[list[RequestResult], float]]] = {b: [] for b in builds}
        for rnd in range(self.a.rounds):
            for b in builds[rnd % len(builds):] + builds[:rnd % len(builds)]:
                before = _cpu_snapshot(self.fleet, b)
                rs = await self.closed(b, "refusal", REFUSAL_CONCURRENCY, self.a.refusal_s, False, 4,
                                       headers=(("X-TTFT-Target", "0.001"),))
                runs[b].append((rs, sum(procs.cpu_delta(before, _cpu_snapshot(self.fleet, b)).values())))
        out = _refusal_row(runs[t])
        if len(builds) > 1:
            out["base"] = _refusal_row(runs[builds[1]])
        return out


def _refusal_row(rounds: list[tuple[list[RequestResult], float]]) -> dict[str, Any]:
    """One build's refusal rounds pooled: refusals over the rounds' own durations (not the span
    across them, which holds the other build's rounds), CPU over every refusal."""
    ss = [summarize(rs, LOOSE_SLO) for rs, _ in rounds]
    refused, duration, cpu = sum(s["refused"] for s in ss), sum(s["duration_s"] for s in ss), sum(c for _, c in rounds)
    pooled = summarize([r for rs, _ in rounds for r in rs], LOOSE_SLO)
    return {
        "offered": pooled["offered"], "refused": refused, "error_codes": pooled["error_codes"],
        "concurrency": REFUSAL_CONCURRENCY, "rounds": len(rounds),
        "refusals_per_s": round(refused / duration, 1) if duration else None,
        "latency_ms": pooled["refusal_latency_ms"],
        "cpu_ms_per_refusal": round(1000 * cpu / refused, 3) if refused else None,
    }


def _latency_row(s: dict[str, Any]) -> dict[str, Any]:
    return {"n": s["completed"], "failed": s["failed"], "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "itl_p50": s["itl_ms"]["p50"], "itl_p99": s["itl_ms"]["p99"], "e2e_p50": s["e2e_ms"]["p50"],
            "e2e_p99": s["e2e_ms"]["p99"], "chunks_per_req": _chunks(s)}


def _chunks(s: dict[str, Any]) -> float | None:
    n = s["completed"]
    return round(s["itl_ms"]["n"] / n + 1, 2) if n else None


def _add_deltas(rows: dict[str, dict[str, Any]]) -> None:
    d, p = rows.get("direct"), rows.get("proxy")
    for row in rows.values():
        for k in ("ttft_p50", "ttft_p99", "itl_p99"):
            row[f"added_{k}"] = diff(row[k], d[k]) if d else None
            row[f"{k}_vs_proxy"] = ratio(row[k], p[k]) if p else None


# the hot path's targets (docs/performance.md): added TTFT by concurrency (p50, p99; None: not
# judged), added ITL p99, router CPU per request at c=8, the refusal path against the success path
ADDED_TTFT_MS = {1: (4.0, 8.0), 8: (12.0, None)}
ADDED_ITL_P99_MS = 1.0
CPU_MS_PER_REQ = 3.0
REFUSALS_VS_SUCCESS = 5.0
# the refusal phase's clients: the concurrency of the success path it is compared with (until
# 2026-12-07 it ran at 32 against successes at 8: not like for like)
REFUSAL_CONCURRENCY = 8


def overhead_checks(lat: dict[str, Any], tput: dict[str, Any], refusal: dict[str, Any] | None = None
                    ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in ("narwhal-open", "narwhal-predictive"):
        for c, rows in lat.items():
            p50, p99 = ADDED_TTFT_MS.get(int(c), (None, None))
            if t not in rows:
                continue
            if p50 is not None:
                out.append(check(f"{t} added TTFT p50 c={c} (ms)", rows[t]["added_ttft_p50"], "<=", p50))
            if p99 is not None:
                out.append(check(f"{t} added TTFT p99 c={c} (ms)", rows[t]["added_ttft_p99"], "<=", p99))
            out.append(check(f"{t} added ITL p99 c={c} (ms)", rows[t]["added_itl_p99"], "<=", ADDED_ITL_P99_MS))
        for c, rows in tput.items():
            if t in rows:
                out.append(check(f"{t} throughput / proxy c={c}", rows[t]["vs_proxy"], ">=", 0.5))
                if int(c) == 8:
                    out.append(check(f"{t} router CPU ms per request c={c}", rows[t]["cpu_ms_per_req"], "<=",
                                     CPU_MS_PER_REQ))
    success = tput.get("8", {}).get("narwhal-predictive", {}).get("req_per_s")
    if refusal is not None and refusal.get("refusals_per_s") and success:
        out.append(check("refusals/s ÷ successes/s at c=8", round(refusal["refusals_per_s"] / success, 2), ">=",
                         REFUSALS_VS_SUCCESS))
    return out


async def run_overhead(a: OverheadArgs, fleet: Fleet, targets: list[str]) -> dict[str, Any]:
    run = OverheadRun(a, fleet, targets)
    await run.warmup()
    lat = await run.latency()
    tput = await run.throughput()
    refusal = await run.refusals()
    return {"latency": lat, "throughput": tput, "refusal": refusal, "checks": overhead_checks(lat, tput, refusal),
            "_log": run.log}
