"""``narwhal-bench soak``: a long mixed load with faults against Narwhal in its run mode, watching
the memory of every process of the run and, at the end, the router's books.

Starts ``scripts/serve_run.py`` (the run command: ``serve run`` under its supervisor, direct ingress
behind Serve's HAProxy with Narwhal's wrapper, predictive admission, the embedded simulated fleet —
a prefill/decode pair and a unified engine, the shape of ``serve_config.yaml``'s managed fleet, on
fixed ports the soak reads directly) on free ports. Then, for
``minutes``:

* ``concurrency`` closed-loop clients send a mix (:func:`plan_request`): chat and completions,
  streaming or not, lognormal prompt and output lengths, ``stream_options.include_usage`` on or off,
  some chat requests with a simulator script (reasoning, tool calls, refusal, ...). A ``fault_rate``
  share carries a per-request simulator fault (``"sim": {"fault": NAME, "fault_after": K}``: every
  name of ``FAULT_NAMES`` that acts per request; the hangs with an ``X-Request-Timeout`` of a few
  seconds, so they end). A ``disconnect_rate`` share leave: half mid-stream (after a few events), half
  before response headers. A ``malformed_rate`` share send a body Narwhal must refuse (400): bad
  JSON, missing or mistyped fields — and one in five stops sending its body half-way.
* every ``engine_fault_every_s`` one engine gets an engine-wide fault for ``engine_fault_s``
  (``unhealthy``, ``error_500``, ``stale_metrics``, rotating over engines and faults) through the
  simulator's ``POST /sim/control``; none starts in the last ``engine_fault_s + 30`` s of the load.
* every ``sample_s``: the RSS (``VmRSS``) of every process of the run — the supervisor's process
  tree, grouped by role (:func:`role_for`) — and ``/status``'s gauges; one JSON line each in
  ``samples.jsonl``.

Then the clients stop, the engine faults are cleared, and it waits (bounded by
``quiesce_timeout_s``) until the router is quiescent: every offered request counted in a terminal
class and no permit held. It reads ``/status``, takes a last sample, stops the run (SIGTERM to the
supervisor: ``serve run``'s clean shutdown, then leftovers by PID; also on Ctrl-C, SIGTERM or an
error) and reports: requests by kind and client-side outcome, the status-code tally, the router's
outcomes by reason, leaked permits, whether the counters balance, and per role the RSS first /
baseline / last / max with the growth from the baseline — the first sample at or after
``baseline_s``, by default 10 % into the load — to the last sample. Exit status 1 when a permit
leaked, the counters do not balance, or a Narwhal role (every role but Ray's own processes, which
are reported, not judged) grew by ``max_growth_pct`` or more.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from narwhal_serve.bench import procs
from narwhal_serve.bench.client import Endpoint, make_session
from narwhal_serve.bench.fleet import app_dir, sim_idle, narwhal_app, serve_config
from narwhal_serve.bench.harness import SUPERVISED, narwhal_run, terminate_as_interrupt
from narwhal_serve.bench.ramp import serve_env
from narwhal_serve.bench.rss import APP, group_roles, judged, sample_processes
from narwhal_serve.bench.report import run_dir, write_json
from narwhal_serve.bench.stats import RequestResult
from narwhal_serve.bench.soak_report import books, plot, report
from narwhal_serve.bench.soak_mix import ENGINE_FAULTS, SoakArgs, execute, outcome, plan_request, status_key
from narwhal_serve.config import NarwhalConfig, SimFleetConfig

SUPERVISOR = Path("scripts") / "serve_run.py"


# --- engine-wide faults ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Episode:
    start_s: float
    end_s: float
    engine: str
    fault: str


def engine_fault_schedule(load_s: float, every_s: float, hold_s: float, engines: Sequence[str],
                          faults: Sequence[str] = ENGINE_FAULTS, tail_s: float = 30.0) -> list[Episode]:
    """Episode ``k`` starts at ``(k + 1) × every_s``, on engine ``k mod E`` with fault
    ``(k + k div E) mod F`` (so every pair comes up), and ends ``hold_s`` later; none ends within
    ``tail_s`` of the load's end (the fleet is whole again before the books are read)."""
    out: list[Episode] = []
    if every_s <= 0 or not engines or not faults:
        return out
    k = 0
    while (k + 1) * every_s + hold_s <= load_s - tail_s:
        start = (k + 1) * every_s
        fault = faults[(k + k // len(engines)) % len(faults)]
        out.append(Episode(round(start, 3), round(start + hold_s, 3), engines[k % len(engines)], fault))
        k += 1
    return out


# --- the run ---------------------------------------------------------------------------------------


def soak_serve_config(port: int, sim_base: int, model: str) -> dict[str, Any]:
    """``serve_config.yaml``'s application (predictive admission, every other setting at its default,
    which that file repeats) on ``port``, with the embedded fleet of the same shape (a prefill/decode
    pair and a unified engine) from ``sim_base``: its engines' URLs are known before the run starts."""
    args = {"model": model, "admission": {"mode": "predictive"}, "engines": [], "sim": {"base_port": sim_base}}
    return serve_config(port, [narwhal_app(args, APP)])


def sim_engines(cfg: dict[str, Any]) -> dict[str, str]:
    """``{name: URL}`` of the simulated engines a :func:`soak_serve_config` config starts."""
    args = NarwhalConfig.model_validate(cfg["applications"][0]["args"])
    return {e.name: e.url for e in args.resolved_engines()}


def output_paths(out: Path) -> tuple[Path, Path]:
    """(results JSON, folder for logs and samples): ``--out x.json`` writes there, its files in
    ``x-files/``; a folder gets ``soak-<time>/results.json``."""
    if out.suffix == ".json":
        folder = out.with_name(out.stem + "-files")
        folder.mkdir(parents=True, exist_ok=True)
        return out, folder
    folder = run_dir(out, "soak")
    return folder / "results.json", folder


@dataclass
class Soak:
    a: SoakArgs
    base: str
    engines: dict[str, str]  # name -> URL of the simulated engines
    supervisor: procs.Managed
    samples_path: Path
    samples: list[dict[str, Any]] = field(default_factory=list)
    tally: Counter[tuple[str, str]] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    episodes: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0
    done: int = 0
    completed: int = 0
    fault_now: str = "-"
    final_status: dict[str, Any] | None = None
    quiesce_s: float | None = None
    t0: float = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def _worker(self, w: int, session: aiohttp.ClientSession, ep: Endpoint, stop_at: float) -> None:
        rng = np.random.default_rng([self.a.seed, w])
        while time.monotonic() < stop_at:
            p = plan_request(rng, self.a, self.sent)
            self.sent += 1
            r = RequestResult(idx=p.spec.idx, target=ep.name, sent=0.0, prompt_tokens=p.spec.prompt_tokens,
                              max_tokens=p.spec.output_tokens)
            try:
                await execute(session, ep, p, r, self.t0)
            finally:
                self.done += 1
                self.completed += int(p.kind in ("normal", "fault") and r.ok)
                self.tally[(p.tag, outcome(r))] += 1
                self.statuses[status_key(r)] += 1
            if self.a.think_s > 0:
                await asyncio.sleep(float(rng.exponential(self.a.think_s)))

    async def _status(self, session: aiohttp.ClientSession) -> dict[str, Any] | None:
        try:
            async with session.get(self.base + "/status", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status == 200:
                    snap: dict[str, Any] = await resp.json()
                    return snap
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        return None

    async def sample(self, session: aiohttp.ClientSession, phase: str) -> dict[str, Any]:
        rows = await asyncio.to_thread(sample_processes, self.supervisor.pid)
        self.supervisor.known = {pid for pid, _, _ in rows if pid != self.supervisor.pid}  # live ones only
        snap = await self._status(session)
        s = {"t": round(self.now(), 2), "phase": phase, "roles": group_roles(rows),
             "status": None if snap is None else {**books(snap), "leases": len(snap.get("admission_leases", []))}}
        self.samples.append(s)
        with self.samples_path.open("a") as fh:
            fh.write(json.dumps(s) + "\n")
        return s

    def _line(self, s: dict[str, Any], last_done: int, dt: float) -> str:
        nw = sum(g["rss_kb"] for r, g in s["roles"].items() if judged(r))
        st = s["status"] or {}
        return (f"[soak {s['phase']}] {s['t']:7.1f}s sent {self.sent} done {self.done} "
                f"({(self.done - last_done) / dt if dt > 0 else 0.0:.1f}/s) completed {self.completed} | "
                f"engine fault {self.fault_now} | permits in use {st.get('leaked_permits', '?')} | "
                f"Narwhal RSS {nw / 1024:.0f} MB")

    async def _sampler(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        last_done, last_t = 0, self.now()
        while True:
            s = await self.sample(session, "load")
            print(self._line(s, last_done, self.now() - last_t), file=sys.stderr, flush=True)
            last_done, last_t = self.done, self.now()
            try:
                await asyncio.wait_for(stop.wait(), self.a.sample_s)
                return
            except TimeoutError:
                continue

    async def _control(self, session: aiohttp.ClientSession, engine: str, faults: list[str]) -> int:
        try:
            async with session.post(self.engines[engine] + "/sim/control", json={"faults": faults},
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return resp.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    async def _engine_faults(self, session: aiohttp.ClientSession) -> None:
        plan = engine_fault_schedule(self.a.load_s, self.a.engine_fault_every_s, self.a.engine_fault_s,
                                     list(self.engines))
        try:
            for ep in plan:
                await asyncio.sleep(max(0.0, ep.start_s - self.now()))
                on = await self._control(session, ep.engine, [ep.fault])
                self.fault_now = f"{ep.fault}@{ep.engine}"
                await asyncio.sleep(max(0.0, ep.end_s - self.now()))
                off = await self._control(session, ep.engine, [])
                self.fault_now = "-"
                self.episodes.append({**asdict(ep), "on_status": on, "off_status": off})
        finally:
            await asyncio.shield(self._clear_faults(session))

    async def _clear_faults(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._control(session, e, []) for e in self.engines))
        self.fault_now = "-"

    async def _quiesce(self, session: aiohttp.ClientSession) -> None:
        """Wait (bounded) until the engines are idle and the router's books close."""
        t_end = time.monotonic()
        deadline = t_end + self.a.quiesce_timeout_s
        while time.monotonic() < deadline:
            idle = await asyncio.to_thread(lambda: all(sim_idle(u) for u in self.engines.values()))
            snap = await self._status(session)
            if snap is not None:
                self.final_status = snap
                if idle and books(snap)["balanced"]:
                    self.quiesce_s = round(time.monotonic() - t_end, 2)
                    return
            await asyncio.sleep(0.5)

    async def run(self) -> None:
        ep = Endpoint(APP, (self.base,))
        async with make_session() as session:
            self.t0 = time.monotonic()
            stop_at = self.t0 + self.a.load_s
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            sampler = loop.create_task(self._sampler(session, stop))
            faults = loop.create_task(self._engine_faults(session))
            workers = [loop.create_task(self._worker(w, session, ep, stop_at)) for w in range(self.a.concurrency)]
            try:
                _, pending = await asyncio.wait(workers, timeout=self.a.load_s + 70.0)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
            finally:
                for t in workers:
                    t.cancel()
                faults.cancel()
                await asyncio.gather(faults, return_exceptions=True)
                stop.set()
                await asyncio.gather(sampler, return_exceptions=True)
            print(f"[soak] load over at {self.now():.0f} s: {self.done} requests; waiting for quiescence "
                  f"(up to {self.a.quiesce_timeout_s:.0f} s)", file=sys.stderr, flush=True)
            await self._quiesce(session)
            await self.sample(session, "after")


def run(a: SoakArgs, out: Path, run_async: Callable[[Coroutine[Any, Any, Any]], Any]) -> tuple[dict[str, Any], int]:
    """The whole soak; returns the results and the exit status (0 when every check passes, 130 when
    interrupted)."""
    root = app_dir()
    if not (root / SUPERVISOR).is_file():
        raise SystemExit(f"{SUPERVISOR} not found under {root}: run narwhal-bench soak from the repository checkout")
    results_path, folder = output_paths(out)
    log_dir = folder / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    port, gcs_port = procs.free_port(), procs.free_port()
    cfg = soak_serve_config(port, procs.free_port_run(len(SimFleetConfig().engines), 21000), a.model)
    engines = sim_engines(cfg)
    soak: Soak | None = None
    startup_s: float | None = None
    interrupted = False
    t_start = time.monotonic()
    print(f"narwhal-bench soak: {a.minutes:g} min, {a.concurrency} clients; starting {SUPERVISOR} on port {port} "
          f"(logs in {log_dir})", file=sys.stderr, flush=True)
    try:
        with terminate_as_interrupt(), narwhal_run(
                [sys.executable, str(root / SUPERVISOR)], cfg, port, log_dir, env=serve_env(log_dir, gcs_port, a.ray_env),
                cwd=root, start_timeout_s=a.start_timeout_s, stop=SUPERVISED,
                on_stop="[soak] stopping the run (Serve's clean shutdown, ~15 s; interrupts are ignored meanwhile)") as run_:
            startup_s = run_.startup_s
            print(f"ready in {startup_s:.1f} s; engines {engines}", file=sys.stderr, flush=True)
            soak = Soak(a, run_.base, engines, run_.proc, folder / "samples.jsonl")
            run_async(soak.run())
    except KeyboardInterrupt:
        interrupted = True
        print("\n[soak] interrupted: the run was stopped", file=sys.stderr, flush=True)
    if soak is None:
        return {}, 130 if interrupted else 1
    res, text, checks = report(a, soak)
    judged_roles = [r["role"] for r in res["rss"] if r["judged"]]
    plotted = plot(soak, judged_roles, folder / "rss.png")
    meta = {"mode": "soak", "args": {**asdict(a), "ray_env": dict(a.ray_env)}, "baseline_at_s": a.baseline_at_s,
            "serve_config": cfg, "engines": engines, "startup_s": startup_s, "interrupted": interrupted,
            "wall_s": round(time.monotonic() - t_start, 1), "samples_file": str(soak.samples_path)}
    res = {"meta": meta, **res, "samples": soak.samples, "plots": [str(plotted)] if plotted else []}
    write_json(results_path, res)
    if interrupted:
        print("INTERRUPTED: the load was cut short and the books were not read after quiescence\n")
    print(text)
    print(f"\nresults: {results_path}\nsamples: {soak.samples_path}\nlogs: {log_dir}")
    if plotted:
        print(f"plot: {plotted}")
    if interrupted:
        return res, 130
    return res, (1 if any(c["verdict"] == "MISS" for c in checks) else 0)

