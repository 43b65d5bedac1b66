"""``narwhal-bench ramp``: Serve autoscaling of Ingress and Assembler under a load ramp.

Starts Narwhal with ``serve run`` in direct-ingress mode (the run mode; ``--ray-env
RAY_SERVE_ENABLE_HA_PROXY=0`` for Serve's proxy actor) on 127.0.0.1, with the embedded simulated
fleet and an autoscaling configuration small enough to act on a 2-core machine (``deployment.*``
knobs: 1 → 3 replicas each, 2 ongoing requests per replica, short delays). Then:

1. baseline: a few idle seconds;
2. ramp: closed-loop streaming chat clients, ``peak`` of them at most; the number allowed to send
   rises step by step over ``ramp_up_s``, holds for ``hold_s``, falls to zero over ``ramp_down_s``;
3. settle: no load, until both deployments are back at their minimum with no replica starting or
   stopping (bounded by ``settle_timeout_s``).

Serve's own replica counts (``serve.status()``) are sampled every ``sample_interval_s`` by
``scripts/serve_replicas.py``, a second Ray driver connected to this run's GCS (``serve run`` is
started with ``RAY_GCS_SERVER_PORT``): that script imports Ray, this module never does. Every
request's outcome is kept. Output: the timeline (time → clients, requests in flight, replicas of
each deployment, requests ok / failed / refused so far), the checks (peak replicas above the
minimum, back at the minimum at the end, no failed request), ``results.json``, ``requests.jsonl``,
``samples.jsonl`` and a plot, under ``--out/ramp-<time>/``.
"""

from __future__ import annotations

import asyncio
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from narwhal_serve.bench import procs
from narwhal_serve.bench.client import Endpoint, Shape, make_session, send_one
from narwhal_serve.bench.ramp_report import APP, DEPLOYMENTS, level_at, outcome, plot, read_samples, replica_cell, replicas, settled, summarize_ramp, timeline, timeline_table
from narwhal_serve.bench.fleet import app_dir, bench_serve_env, narwhal_app, serve_config
from narwhal_serve.bench.harness import SERVE_RUN, Stop, narwhal_run, stop_uninterrupted, terminate_as_interrupt
from narwhal_serve.bench.report import RequestLog, checks_table, write_json
from narwhal_serve.bench.stats import RequestResult
from narwhal_serve.bench.workload import Api, LengthDist, RequestSpec, Workload
from narwhal_serve.config import DeploymentKnobs

SAMPLER = Path("scripts") / "serve_replicas.py"


def default_knobs() -> dict[str, Any]:
    """The ``deployment`` section the ramp runs with (overridable from the command line)."""
    return {"ingress_min_replicas": 1, "ingress_max_replicas": 3, "ingress_target_ongoing_requests": 2.0,
            "assembler_min_replicas": 1, "assembler_max_replicas": 3, "assembler_target_ongoing_requests": 2.0,
            "upscale_delay_s": 3.0, "downscale_delay_s": 15.0, "look_back_period_s": 5.0,
            "metrics_interval_s": 1.0, "relay": "assembler"}  # both deployments scale (the default has no Assembler)


@dataclass(frozen=True)
class RampArgs:
    peak: int = 12  # clients at the top of the ramp
    ramp_up_s: float = 60.0
    hold_s: float = 20.0
    ramp_down_s: float = 60.0
    step_s: float = 5.0  # the client count changes every step_s
    baseline_s: float = 5.0
    settle_timeout_s: float = 120.0
    sample_interval_s: float = 1.0
    prompt_tokens: int = 64
    output_tokens: int = 32
    tpot_s: float = 0.03  # simulated seconds per output token: a request streams for ~output_tokens × tpot_s
    engines: int = 2  # embedded simulated engines (unified)
    admission: Literal["predictive", "open"] = "predictive"
    api: Api = "chat"
    model: str = "narwhal-sim"
    seed: int = 0
    knobs: dict[str, Any] = field(default_factory=default_knobs)
    ray_env: tuple[tuple[str, str], ...] = ()
    start_timeout_s: float = 180.0
    table_every_s: float = 5.0


def schedule(a: RampArgs) -> list[tuple[float, int]]:
    """``(start second, clients)`` steps: up to ``peak`` over ``ramp_up_s``, held, down to 0 over
    ``ramp_down_s``; the last step (0 clients) marks the end of the load."""
    up = max(1, round(a.ramp_up_s / a.step_s))
    down = max(1, round(a.ramp_down_s / a.step_s))
    steps = [(k * a.ramp_up_s / up, math.ceil(a.peak * (k + 1) / up)) for k in range(up)]
    top = a.ramp_up_s + a.hold_s
    if a.hold_s > 0:
        steps.append((a.ramp_up_s, a.peak))
    steps += [(top + k * a.ramp_down_s / down, math.floor(a.peak * (down - k) / down)) for k in range(1, down + 1)]
    out: list[tuple[float, int]] = []
    for t, n in steps:  # drop steps that do not change the count
        if not out or out[-1][1] != n:
            out.append((round(t, 3), n))
    return out


def ramp_serve_config(port: int, sim_base: int, a: RampArgs) -> dict[str, Any]:
    """The ``serve run`` config: one application at ``/``, the embedded simulated fleet, the knobs."""
    engines = [{"name": f"sim-unified-{i}", "role": "unified", "tpot_base_s": a.tpot_s, "tpot_per_running_s": 0.0,
                "max_num_seqs": 256, "eos_prob": 0.0} for i in range(a.engines)]
    args = {
        "model": a.model,
        "admission": {"mode": a.admission},
        "sim": {"base_port": sim_base, "engines": engines},
        "deployment": dict(a.knobs),
    }
    return serve_config(port, [narwhal_app(args, APP)])


# --- the run -------------------------------------------------------------------------------------


class Ramp:
    def __init__(self, a: RampArgs, base_url: str, samples_path: Path) -> None:
        self.a = a
        self.sched = schedule(a)
        self.ep = Endpoint("narwhal", (base_url,))
        self.shape = Shape(api=a.api, model=a.model, stream=True, timeout_s=60.0)
        wl = Workload(LengthDist(a.prompt_tokens, 0.0, a.prompt_tokens, a.prompt_tokens),
                      LengthDist(a.output_tokens, 0.0, a.output_tokens, a.output_tokens), seed=a.seed)
        self.pool: list[RequestSpec] = wl.closed_loop_specs(256)
        self.samples_path = samples_path
        self.results: list[RequestResult] = []
        self.level = 0
        self.stop = False
        self.t0 = 0.0  # perf_counter at the start of the load
        self.t0_wall = 0.0  # time.time() at the same moment

    def latest(self) -> dict[str, Any]:
        s = read_samples(self.samples_path)
        return s[-1] if s else {}

    def _status_line(self, phase: str) -> str:
        now = time.perf_counter() - self.t0
        rs = self.results
        inflight = sum(1 for r in rs if r.e2e is None)
        c = Counter(outcome(r) for r in rs if r.e2e is not None)
        last = self.latest()
        reps = " ".join(f"{d} {replica_cell(replicas(last, d))}" for d in DEPLOYMENTS)
        return (f"[ramp {phase}] {now:6.1f}s clients {self.level:3d} in flight {inflight:3d} ok {c['ok']} "
                f"failed {c['failed']} refused {c['refused']} | {reps}")

    async def _worker(self, i: int, session: Any) -> None:
        n = 0
        while not self.stop:
            if i >= self.level:
                await asyncio.sleep(0.05)
                continue
            spec = replace(self.pool[(i * 7919 + n) % len(self.pool)], idx=len(self.results))
            n += 1
            r = RequestResult(idx=spec.idx, target=self.ep.name, sent=0.0, prompt_tokens=spec.prompt_tokens,
                              max_tokens=spec.output_tokens)
            self.results.append(r)
            await send_one(session, self.ep, self.shape, spec, r, self.t0)

    async def run(self) -> None:
        a = self.a
        end = self.sched[-1][0]
        async with make_session() as session:
            self.t0, self.t0_wall = time.perf_counter(), time.time()
            workers = [asyncio.get_running_loop().create_task(self._worker(i, session)) for i in range(a.peak)]
            last_print = -1e9
            try:
                while True:
                    now = time.perf_counter() - self.t0
                    self.level = level_at(self.sched, now)
                    if now >= end:
                        break
                    if now - last_print >= 5.0:
                        print(self._status_line("load"), file=sys.stderr, flush=True)
                        last_print = now
                    await asyncio.sleep(0.05)
            finally:
                self.stop = True
                self.level = 0
                done, pending = await asyncio.wait(workers, timeout=self.shape.timeout_s + 5.0)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        for r in self.results:
            if r.e2e is None and r.error_code is None:
                r.error_code = "cut"

    async def settle(self, mins: dict[str, int]) -> float | None:
        """Wait (bounded) until Serve is back at the minimum; the seconds since the load ended."""
        t_end = time.perf_counter()
        last_print = t_end
        while time.perf_counter() - t_end < self.a.settle_timeout_s:
            last = self.latest()
            if last and last.get("t", 0.0) > self.t0_wall and settled(last, mins):
                return time.perf_counter() - t_end
            if time.perf_counter() - last_print >= 5.0:
                print(self._status_line("settle"), file=sys.stderr, flush=True)
                last_print = time.perf_counter()
            await asyncio.sleep(self.a.sample_interval_s / 2)
        return None


def serve_env(log_dir: Path, gcs_port: int, extra: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """``serve run``'s environment: the run mode's (direct ingress with the HAProxy wrapper), this
    run's own HAProxy ports, the GCS on ``gcs_port``, workers at nice 0; ``extra`` wins."""
    return bench_serve_env(log_dir, extra, RAY_worker_niceness="0",
                           # the run mode's draining window (scripts/serve_run.py), not the tests' 1 s
                           RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="5",
                           RAY_GCS_SERVER_PORT=str(gcs_port))  # the sampler connects here


def _wait_first_sample(path: Path, sampler: procs.Managed, timeout_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if any(s.get("apps", {}).get(APP, {}).get("status") == "RUNNING" for s in read_samples(path)):
            return
        if not sampler.alive():
            raise RuntimeError(f"the Serve status sampler exited with {sampler.popen.returncode}; see {sampler.log}")
        time.sleep(0.25)
    raise RuntimeError(f"no Serve status sample after {timeout_s:.0f} s; see {sampler.log}")


def run(a: RampArgs, out: Path,
        run_async: Callable[[Coroutine[Any, Any, Any]], Any]) -> tuple[dict[str, Any], int]:
    """The whole bench; returns the results and the exit status (0 when every check passes)."""
    knobs = DeploymentKnobs.model_validate(a.knobs)  # a bad knob fails here, naming the key
    root = app_dir()
    sampler_script = root / SAMPLER
    if not sampler_script.is_file():
        raise SystemExit(f"{SAMPLER} not found under {root}: run narwhal-bench ramp from the repository checkout")
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    port, gcs_port, sim_base = procs.free_port(), procs.free_port(), procs.free_port_run(a.engines, 21000)
    cfg = ramp_serve_config(port, sim_base, a)
    samples_path = out / "samples.jsonl"
    serve_bin = Path(sys.executable).parent / "serve"
    base = f"http://127.0.0.1:{port}"
    ramp = Ramp(a, base, samples_path)
    settle_s: float | None = None
    t_start = time.monotonic()
    print(f"narwhal-bench ramp: starting serve run on {base} (logs in {log_dir})", file=sys.stderr, flush=True)
    with terminate_as_interrupt(), narwhal_run([str(serve_bin), "run"], cfg, port, log_dir,
                                               env=serve_env(log_dir, gcs_port, a.ray_env), cwd=root,
                                               start_timeout_s=a.start_timeout_s, stop=SERVE_RUN) as run_:
        sampler = procs.start("sampler", [sys.executable, str(sampler_script), "--address", f"127.0.0.1:{gcs_port}",
                                          "--app", APP, "--interval-s", str(a.sample_interval_s),
                                          "--out", str(samples_path)], log_dir)
        try:
            _wait_first_sample(samples_path, sampler, 60.0)
            print(f"ready in {run_.startup_s:.1f} s; baseline {a.baseline_s:.0f} s, then the ramp: "
                  + ", ".join(f"{t:.0f}s→{n}" for t, n in ramp.sched), file=sys.stderr, flush=True)
            time.sleep(a.baseline_s)
            run_async(ramp.run())
            mins = {"Ingress": knobs.ingress_min_replicas, "Assembler": knobs.assembler_min_replicas}
            settle_s = run_async(ramp.settle(mins))
            time.sleep(2 * a.sample_interval_s)  # a last sample or two at rest
        finally:
            stop_uninterrupted(sampler, Stop(signal.SIGINT, 15.0, 5.0))
    samples = read_samples(samples_path)
    rows = timeline(samples, ramp.results, ramp.sched, ramp.t0_wall)
    summary = summarize_ramp(rows, ramp.results, knobs, settle_s)
    RequestLog(out / "requests.jsonl").write({"phase": "ramp"}, ramp.results)
    plotted = plot(rows, out)
    autoscaling = {"Ingress": knobs.autoscaling("ingress"), "Assembler": knobs.autoscaling("assembler")}
    res = {"meta": {"mode": "ramp", "args": {**asdict(a), "ray_env": dict(a.ray_env)}, "schedule": ramp.sched,
                    "serve_config": cfg, "autoscaling": autoscaling,
                    "wall_s": round(time.monotonic() - t_start, 1), "t0_unix": ramp.t0_wall},
           "summary": summary, "timeline": rows, "plots": [str(plotted)] if plotted else []}
    path = write_json(out / "results.json", res)
    misses = [c for c in summary["checks"] if c["verdict"] != "PASS"]
    print("\n## replicas over time (Serve's status; running, +starting, -stopping)")
    print(timeline_table(rows, a.table_every_s))
    print("\n## autoscaling config")
    for d, conf in autoscaling.items():
        print(f"  {d}: " + ", ".join(f"{k}={v}" for k, v in conf.items()))
    print("\n## summary")
    rq = summary["requests"]
    print(f"  requests {rq['total']}: ok {rq['ok']}, failed {rq['failed']}, refused {rq['refused']}"
          + (f"; not ok by code {rq['error_codes']}" if rq["error_codes"] else ""))
    for d, s in summary["deployments"].items():
        print(f"  {d}: min {s['min']} max {s['max']}; initial {s['initial']}, peak {s['peak']}, final {s['final']}; "
              f"first scale-up at {s['first_scale_up_t']} s, back at min from {s['back_at_min_t']} s")
    print(f"  back at the minimum {summary['settle_s']} s after the load ended" if settle_s is not None
          else f"  NOT back at the minimum within {a.settle_timeout_s:.0f} s after the load ended")
    print(checks_table(summary["checks"]))
    print(f"\nresults: {path}\nper request: {out / 'requests.jsonl'}\nServe samples: {samples_path}")
    if plotted:
        print(f"plot: {plotted}")
    return res, (1 if misses else 0)
