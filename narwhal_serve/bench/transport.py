"""``narwhal-bench transport``: the engine client's HTTP stack, compared in one run.

One simulated engine runs as a subprocess (no prefill cost, ``--tpot-s`` per token, default 0), so
that ``time.process_time`` of this process is the client's CPU alone.  Against it, each variant

* ``httpx``: ``httpx.AsyncClient`` configured as ``deployments/assembler.py`` ``engine_client()``;
* ``httpx-aiohttp``: the same client API over ``httpx_aiohttp.AiohttpTransport`` (an unlimited
  aiohttp connector, see :func:`aiohttp_session`);
* ``aiohttp``: a bare ``aiohttp.ClientSession`` with an equivalent minimal SSE loop (the floor);

sends closed-loop streaming chat completions (``--tokens`` tokens each).  The httpx variants go
through the project's own :func:`narwhal_serve.engines.client.stream_chunks`.  Phases are
``(round, concurrency, variant)``; within a round and concurrency the variants run in an order
rotated every round (see :func:`schedule`), so machine noise hits all alike.  Every phase is
preceded by an unmeasured warm-up at the same concurrency (the pool holds its connections).

Reported per concurrency and variant: time to first chunk (p50/p99), requests/s, client CPU per
request (``process_time`` delta / requests) and the engine's CPU per request (``/proc``).

The variants are :mod:`.transport_clients`. Before the benchmark, unless ``--skip-checks``,
:func:`~.transport_checks.run_checks` runs the project's code paths
(``stream_chunks``, ``post_json``) over both httpx variants against an in-process engine and raw
TCP servers: complete streams, failure mapping to ``EngineFailure`` (with the exception chain that
caused it), cancellation closing the upstream connection, and the connection-pool limit.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from narwhal_serve.bench import procs
from narwhal_serve.bench.report import table, write_json
from narwhal_serve.bench.stats import percentile
from narwhal_serve.bench.transport_checks import Check, checks_table, run_checks
from narwhal_serve.bench.transport_clients import VARIANTS as VARIANTS
from narwhal_serve.bench.transport_clients import Variant, chat_body, closed_loop, transport_available

DEFINITIONS = {
    "ttfc": "send -> first batch of parsed chunks yielded (the role chunk), client side",
    "rps": "completed requests / summed wall time of the measured phases (closed loop)",
    "client_cpu_ms": "time.process_time() delta of the bench process over the measured phases / requests sent",
    "engine_cpu_ms": "CPU of the simulated engine process (/proc) over the measured phases / requests sent",
    "rounds": "each round runs every variant once per concurrency, in an order rotated every round",
}


# ---- schedule and summary (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    round: int
    concurrency: int
    variant: str


def rotated(items: Sequence[str], k: int) -> list[str]:
    """``items`` rotated left by ``k`` (mod its length)."""
    if not items:
        return []
    k %= len(items)
    return [*items[k:], *items[:k]]


def schedule(variants: Sequence[str], concurrencies: Sequence[int], rounds: int) -> list[Phase]:
    """Rounds, each: for every concurrency, every variant once, rotated by ``round + concurrency index``.

    With ``rounds`` a multiple of ``len(variants)`` every variant runs in every position equally
    often at every concurrency, and the variant that opens a concurrency changes with it too."""
    return [
        Phase(r, c, v)
        for r in range(rounds)
        for ci, c in enumerate(concurrencies)
        for v in rotated(list(variants), r + ci)
    ]


@dataclass
class PhaseResult:
    phase: Phase
    sent: int
    errors: int
    wall_s: float
    cpu_s: float
    engine_cpu_s: float | None = None
    ttfc_s: list[float] = field(default_factory=list)
    error_sample: str | None = None

    @property
    def ok(self) -> int:
        return self.sent - self.errors

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttfc_s"] = [round(x, 6) for x in self.ttfc_s]
        return d


def _ms(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v * 1000.0, nd)


def summarize(results: Sequence[PhaseResult], baseline: str = "httpx") -> list[dict[str, Any]]:
    """One row per (concurrency, variant), ordered by concurrency, then as in :data:`VARIANTS`.

    TTFC percentiles pool every measured request; ``rps`` and CPU per request sum over rounds (so
    a round with more requests weighs more); ``*_rounds`` keep each round's value to show spread;
    ``cpu_vs_<baseline>`` is the client CPU per request relative to ``baseline`` at that concurrency.
    """
    groups: dict[tuple[int, str], list[PhaseResult]] = {}
    for r in results:
        groups.setdefault((r.phase.concurrency, r.phase.variant), []).append(r)
    rows: list[dict[str, Any]] = []
    def order(key: tuple[int, str]) -> tuple[int, int]:
        return key[0], VARIANTS.index(key[1]) if key[1] in VARIANTS else len(VARIANTS)

    for (c, v), rs in sorted(groups.items(), key=lambda kv: order(kv[0])):  # stable among unknown variants
        sent = sum(r.sent for r in rs)
        ok = sum(r.ok for r in rs)
        wall = sum(r.wall_s for r in rs)
        cpu = sum(r.cpu_s for r in rs)
        eng = [r.engine_cpu_s for r in rs]
        ttfc = [x for r in rs for x in r.ttfc_s]
        rows.append({
            "concurrency": c,
            "variant": v,
            "rounds": len(rs),
            "sent": sent,
            "errors": sent - ok,
            "ttfc_p50_ms": _ms(percentile(ttfc, 50)),
            "ttfc_p99_ms": _ms(percentile(ttfc, 99)),
            "rps": round(ok / wall, 1) if wall > 0 else None,
            "client_cpu_ms": _ms(cpu / sent) if sent else None,
            "engine_cpu_ms": _ms(sum(e for e in eng if e is not None) / sent)
            if sent and all(e is not None for e in eng) else None,
            "rps_rounds": [round(r.ok / r.wall_s, 1) if r.wall_s > 0 else None for r in rs],
            "client_cpu_ms_rounds": [_ms(r.cpu_s / r.sent) if r.sent else None for r in rs],
            "error_sample": next((r.error_sample for r in rs if r.error_sample), None),
        })
    base = {row["concurrency"]: row["client_cpu_ms"] for row in rows if row["variant"] == baseline}
    for row in rows:
        b, x = base.get(row["concurrency"]), row["client_cpu_ms"]
        row[f"cpu_vs_{baseline}"] = round(x / b, 2) if b and x is not None else None
    return rows


def summary_table(rows: Sequence[dict[str, Any]], baseline: str = "httpx") -> str:
    def spread(xs: Sequence[float | None]) -> str:
        vs = [x for x in xs if x is not None]
        return f"{min(vs):.2f}-{max(vs):.2f}" if vs else "-"

    headers = ["conc", "variant", "n", "err", "TTFC p50 ms", "TTFC p99 ms", "req/s", "client CPU ms/req",
               "(rounds)", f"CPU vs {baseline}", "engine CPU ms/req"]
    return table(headers, [
        [r["concurrency"], r["variant"], r["sent"], r["errors"], r["ttfc_p50_ms"], r["ttfc_p99_ms"], r["rps"],
         r["client_cpu_ms"], spread(r["client_cpu_ms_rounds"]), r[f"cpu_vs_{baseline}"], r["engine_cpu_ms"]]
        for r in rows
    ])


# ---- the run ----------------------------------------------------------------------------------------


@dataclass
class TransportArgs:
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    concurrencies: list[int] = field(default_factory=lambda: [1, 8, 32])
    rounds: int = 3
    requests: int = 500  # measured per phase
    warmup: int = 32  # unmeasured, before each phase (at least the concurrency)
    tokens: int = 16
    tpot_s: float = 0.0
    model: str = "narwhal-sim"
    checks: bool = True


def _engine_cpu(sim: procs.Managed) -> float:
    return sum(cpu for _, cpu in procs.tree_cpu(sim.pid).values())


async def bench(a: TransportArgs, url: str, sim: procs.Managed | None,
                progress: Callable[[str], None] = lambda s: None) -> list[PhaseResult]:
    body = chat_body(a.model, a.tokens)
    variants = {v: Variant(v, url + "/v1/chat/completions", body) for v in a.variants}
    ids = itertools.count()
    try:
        _, expect = await variants[a.variants[0]].one(next(ids))
        results: list[PhaseResult] = []
        plan = schedule(a.variants, a.concurrencies, a.rounds)
        for i, ph in enumerate(plan):
            v = variants[ph.variant]
            await closed_loop(v.one, max(a.warmup, ph.concurrency), ph.concurrency, None, ids)
            e0 = _engine_cpu(sim) if sim is not None else None
            c0, t0 = time.process_time(), time.perf_counter()
            ttfc, errors, sample = await closed_loop(v.one, a.requests, ph.concurrency, expect, ids)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            e1 = _engine_cpu(sim) if sim is not None else None
            eng = None if e0 is None or e1 is None else e1 - e0
            results.append(PhaseResult(ph, a.requests, errors, wall, cpu, eng, ttfc, sample))
            progress(f"[{i + 1}/{len(plan)}] round {ph.round} c={ph.concurrency} {ph.variant}: "
                     f"{(a.requests - errors) / wall:.0f} req/s, {1000 * cpu / a.requests:.2f} ms CPU/req, "
                     f"{errors} errors")
        return results
    finally:
        for v in variants.values():
            await v.aclose()


def _stderr(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def run(a: TransportArgs, out: Path, loop: str = "uvloop") -> dict[str, Any]:
    """Checks (in-process engine), then the benchmark against a subprocess engine; write
    ``results.json`` in ``out``; return the results."""
    if "httpx-aiohttp" in a.variants and not transport_available():
        _stderr("httpx-aiohttp is not installed: variant httpx-aiohttp skipped")
        a.variants = [v for v in a.variants if v != "httpx-aiohttp"]
    t0 = time.monotonic()
    runner = _runner(loop)
    checks: list[Check] = []
    if a.checks:
        with runner() as r:
            checks = r.run(run_checks(a.model))
        _stderr(checks_table(checks))
    port = procs.free_port()
    argv = procs.python_module(
        "narwhal_serve.sim.cli", "--port", str(port), "--role", "unified", "--model", a.model, "--eos-prob", "0",
        "--prefill-overhead-s", "0", "--prefill-per-token-s", "0", "--tpot-base-s", str(a.tpot_s),
        "--tpot-per-running-s", "0", "--max-num-seqs", str(max(256, *a.concurrencies)))
    sim = procs.start("sim", argv, out / "logs")
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_ready(url + "/health", 30.0, sim)
        with runner() as r:
            phases = r.run(bench(a, url, sim, _stderr))
    finally:
        sim.stop()
    rows = summarize(phases)
    res: dict[str, Any] = {
        "meta": {"mode": "transport", "args": asdict(a), "loop": loop, "httpx": httpx.__version__,
                 "aiohttp": aiohttp.__version__, "httpx_aiohttp": transport_available(),
                 "python": sys.version.split()[0], "wall_s": round(time.monotonic() - t0, 1)},
        "definitions": DEFINITIONS,
        "summary": rows,
        "checks": [asdict(c) for c in checks],
        "phases": [p.to_json() for p in phases],
    }
    write_json(out / "results.json", res)
    return res


def _runner(loop: str) -> Callable[[], asyncio.Runner]:
    if loop == "uvloop":
        try:
            import uvloop

            return lambda: asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            _stderr("uvloop not installed: using asyncio's loop")
    return asyncio.Runner
