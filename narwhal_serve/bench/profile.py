"""``narwhal-bench profile``: where the router's CPU goes per request, hop by hop, and what runs
during the slowest first tokens.

One simulated engine (the overhead fleet: no prefill cost, 1 ms per token) and one Narwhal
application (``--target``; ``<target>@base`` with ``--baseline-tree`` profiles another build); then:

1. **idle**: CPU of every process of the router (each Ray replica, HAProxy, Ray's own daemons) with
   no traffic, as % of a core, then py-spy (raw folded stacks, its own idle filter) on every Python
   process that burned any: what the periodic work is;
2. **load**: ``concurrency`` closed-loop streaming clients for ``duration_s``, no profiler: CPU per
   request of every process from ``/proc`` (HAProxy and Ray's C++ daemons included, which py-spy
   cannot read), TTFT and ITL; then the same load straight at the engine (``direct``) for what the
   router adds;
3. **profiled**: the load again under py-spy (``--nonblocking``, ``--idle``, Chrome-trace format so
   every sample keeps its time) on every Python process that used at least ``min_core_share`` of a
   core in 2.: flame graphs, and the samples inside the slowest ``tail_share`` of first tokens
   (send → first token) against the whole run.

Written under ``bench-results/profile-<time>/``: ``<process>.svg`` and ``<process>.folded`` (flame
graph and folded stacks, for flamegraph.pl / speedscope / inferno, of 3.), ``<process>.idle.svg`` /
``.idle.folded`` (of 1.), ``<process>.tail.folded`` (3., inside the slow windows only),
``<process>.trace.json`` (py-spy's trace of 3., for Perfetto), ``<process>.idle.raw.txt``, ``results.json`` and
``requests.jsonl``.  Printed: CPU per request and idle CPU per process, added TTFT and ITL, each
process's busiest frames under load and with no traffic, and the frames over-represented during
the slow first tokens.  :mod:`narwhal_serve.bench.flame` says how the two py-spy formats are read.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from narwhal_serve.bench import flame, procs
from narwhal_serve.bench.fleet import NARWHAL_PREFIX, Fleet, FleetSpec, base_of
from narwhal_serve.bench.overhead import LOOSE_SLO, OverheadArgs, OverheadRun
from narwhal_serve.bench.report import RequestLog, run_dir, table, write_json
from narwhal_serve.bench.stats import RequestResult, diff, summarize
from narwhal_serve.bench.workload import Api


@dataclass
class ProfileArgs:
    target: str = "narwhal-predictive"
    concurrency: int = 8
    duration_s: float = 15.0
    idle_s: float = 10.0
    rate_hz: int = 100
    tail_share: float = 0.01
    min_core_share: float = 0.02
    prompt_tokens: int = 64
    output_tokens: int = 16
    api: Api = "chat"
    model: str = "narwhal-sim"
    py_spy: str = ""
    ttft_target_s: float | None = None  # sent as X-TTFT-Target: 0.001 profiles the refusal path


def _py_spy(explicit: str) -> str | None:
    if explicit:
        return explicit
    near = Path(sys.executable).parent / "py-spy"
    return str(near) if near.exists() else shutil.which("py-spy")


def _is_python(pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return "python" in Path(exe).name


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label.replace("ray::", "")).strip("_")


@dataclass
class Recording:
    pid: int
    label: str
    path: Path
    popen: subprocess.Popen[bytes]
    spawned_wall: float
    stopped_wall: float = 0.0


def start_recordings(py_spy: str, tree: dict[int, tuple[str, float]], out: Path, rate_hz: int, *,
                     suffix: str, share: dict[str, float], min_share: float, timeline: bool) -> list[Recording]:
    """One py-spy per Python process of ``tree`` whose label used at least ``min_share`` of a core
    (py-spy competes for the router's cores): a Chrome trace with idle samples (``timeline``: when
    each stack ran) or raw folded stacks with py-spy's own idle filter (what a process does)."""
    recs = []
    seen: dict[str, int] = {}
    for pid, (label, _) in sorted(tree.items()):
        if not _is_python(pid) or share.get(label, 0.0) < min_share:
            continue
        name = _safe(label)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}-{seen[name]}"
        name += suffix
        path = out / f"{name}.{'trace.json' if timeline else 'raw.txt'}"
        fmt = ["--idle", "--format", "chrometrace"] if timeline else ["--format", "raw"]
        argv = [py_spy, "record", "--pid", str(pid), "--rate", str(rate_hz), "--nonblocking", *fmt,
                "--output", str(path)]
        popen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        recs.append(Recording(pid, name, path, popen, time.time()))
    return recs


def stop_recordings(recs: list[Recording]) -> list[str]:
    """SIGINT each py-spy (it writes its output on the way out); the errors of those that failed."""
    errors = []
    for r in recs:
        r.stopped_wall = time.time()
        if r.popen.poll() is None:
            r.popen.send_signal(signal.SIGINT)
    for r in recs:
        try:
            _, err = r.popen.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            r.popen.kill()
            _, err = r.popen.communicate()
        if not r.path.exists():
            errors.append(f"{r.label} (pid {r.pid}): {err.decode(errors='replace').strip()[-300:]}")
    return errors


def tail_windows(results: list[RequestResult], wall_t0: float, share: float) -> list[tuple[float, float]]:
    """Wall-clock (send, first token) of the slowest ``share`` of first tokens (at least one)."""
    done = sorted((r for r in results if r.ttft is not None), key=lambda r: -(r.ttft or 0.0))
    k = max(1, int(len(done) * share)) if done else 0
    return [(wall_t0 + r.sent, wall_t0 + r.sent + (r.ttft or 0.0)) for r in done[:k]]


def analyse(rec: Recording, out: Path, period_us: float, span_s: float, what: str,
            windows: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """A recording's flame graph and busiest frames; with ``windows``, also what ran inside them
    against the whole recording."""
    if rec.path.name.endswith(".raw.txt"):
        raw = flame.read_raw(rec.path)
        flame.write_folded(out / f"{rec.label}.folded", raw)
        if raw:
            (out / f"{rec.label}.svg").write_text(flame.svg(raw, f"{rec.label} (pid {rec.pid}), {what}"))
        return {"pid": rec.pid, "samples": sum(raw.values()),
                "busy_share": round(sum(raw.values()) * period_us / 1e6 / span_s, 4),
                "top_own": flame.top_frames(raw, 10, own=True), "top": flame.top_frames(raw, 25)}
    spans = flame.load(rec.path)
    allf = flame.folded(spans, period_us)
    flame.write_folded(out / f"{rec.label}.folded", allf)
    if allf:
        (out / f"{rec.label}.svg").write_text(flame.svg(allf, f"{rec.label} (pid {rec.pid}), {what}"))
    res: dict[str, Any] = {"pid": rec.pid, "samples": sum(allf.values()),
                           "busy_share": round(flame.busy_us(spans) / 1e6 / span_s, 3),
                           "top_own": flame.top_frames(allf, 10, own=True), "top": flame.top_frames(allf, 25)}
    if windows is None:
        return res
    offset = flame.calibrate(spans, rec.stopped_wall, rec.spawned_wall)
    tailf = flame.folded(spans, period_us, windows=windows, offset_wall=offset)
    flame.write_folded(out / f"{rec.label}.tail.folded", tailf)
    win_s = sum(b - a for a, b in windows) or 1e-9
    overall = dict(flame.top_frames(allf, 80))
    lift = sorted(((f, x, x / max(overall.get(f, 0.0), 1e-3)) for f, x in flame.top_frames(tailf, 80) if x >= 0.05),
                  key=lambda t: -t[2])[:6]
    return {**res, "tail_samples": sum(tailf.values()),
            "busy_share_tail": round(flame.busy_us(spans, windows, offset) / 1e6 / win_s, 3),
            "tail_lift": [(f, x, round(r, 2)) for f, x, r in lift]}


class ProfileRun:
    def __init__(self, a: ProfileArgs, fleet: Fleet, out: Path) -> None:
        self.a, self.fleet, self.out = a, fleet, out
        # the overhead bench's closed loop and prompts (its log is this run's requests.jsonl)
        self.loads = OverheadRun(OverheadArgs(prompt_tokens=a.prompt_tokens, output_tokens=a.output_tokens,
                                              api=a.api, model=a.model), fleet, [a.target])
        self.log = self.loads.log

    async def load(self, target: str, label: str, duration_s: float,
                   on_start: Callable[[], None] | None = None) -> list[RequestResult]:
        """Streaming closed-loop clients at ``target`` (``--concurrency`` of them); with
        ``--ttft-target``, each asks for that TTFT (the engine direct ignores it)."""
        t = self.a.ttft_target_s
        headers = () if t is None or target == "direct" else (("X-TTFT-Target", f"{t:g}"),)
        return await self.loads.closed(target, label, self.a.concurrency, duration_s, True, self.a.output_tokens,
                                       on_start=on_start, headers=headers)

    def tree(self) -> dict[int, tuple[str, float]]:
        proc = self.fleet.process(self.a.target)
        assert proc is not None
        return procs.tree_cpu(proc.pid)

    async def measured(self, label: str, duration_s: float, wall0: list[float] | None = None
                       ) -> tuple[list[RequestResult], dict[str, float], float]:
        before = self.tree()
        t0 = time.perf_counter()
        res = await self.load(self.a.target, label, duration_s,
                              on_start=None if wall0 is None else lambda: wall0.append(time.time()))
        wall = time.perf_counter() - t0
        return res, procs.cpu_delta(before, self.tree()), wall

    async def recorded(self, py_spy: str, share: dict[str, float], suffix: str, seconds: float,
                       load: bool) -> tuple[list[Recording], list[str], list[RequestResult], float, float]:
        recs = start_recordings(py_spy, self.tree(), self.out, self.a.rate_hz, suffix=suffix, share=share,
                                min_share=self.a.min_core_share if load else 0.002, timeline=load)
        await asyncio.sleep(1.0)  # py-spy attached (it reads each process's memory maps first)
        wall0: list[float] = []
        t0 = time.perf_counter()
        res: list[RequestResult] = []
        if load:
            res = await self.load(self.a.target, "profiled", seconds, on_start=lambda: wall0.append(time.time()))
        else:
            await asyncio.sleep(seconds)
        wall = time.perf_counter() - t0
        return recs, stop_recordings(recs), res, wall0[0] if wall0 else time.time(), wall

    async def run(self, py_spy: str) -> dict[str, Any]:
        a = self.a
        period_us = 1e6 / a.rate_hz
        await self.load(a.target, "warmup", 2.0)
        await self.load("direct", "warmup", 1.0)
        # 1. no traffic: CPU of every process, then py-spy on those that burned any
        before = self.tree()
        t0 = time.perf_counter()
        await asyncio.sleep(a.idle_s)
        idle = procs.cpu_delta(before, self.tree())
        idle_wall = time.perf_counter() - t0
        idle_share = {k: v / idle_wall for k, v in idle.items()}
        idle_recs, errors, _, _, idle_rec_s = await self.recorded(py_spy, idle_share, ".idle", a.idle_s, load=False)
        # 2. load without py-spy: CPU per request and latency, unperturbed; the engine direct
        before = self.tree()
        t0 = time.perf_counter()
        res = await self.load(a.target, "load", a.duration_s)
        load_wall = time.perf_counter() - t0
        spent = procs.cpu_delta(before, self.tree())
        direct = await self.load("direct", "direct", min(a.duration_s, 8.0))
        # 3. the same load under py-spy, on the processes that worked in 2.
        share = {k: v / load_wall for k, v in spent.items()}
        recs, err, pres, wall0, pwall = await self.recorded(py_spy, share, "", a.duration_s, load=True)
        errors += err
        windows = tail_windows(pres, wall0, a.tail_share)
        s, d, sp = summarize(res, LOOSE_SLO), summarize(direct, LOOSE_SLO), summarize(pres, LOOSE_SLO)
        n = max(1, s["completed"] + s["refused"])  # (refusals too: --ttft-target profiles their path)
        labels = sorted(set(idle) | set(spent), key=lambda k: -spent.get(k, 0.0))
        return {
            "completed": s["completed"], "refused": s["refused"], "failed": s["failed"],
            "req_per_s": round(n / load_wall, 1),
            "cpu_ms_per_req": round(1000 * sum(spent.values()) / n, 3),
            "idle_core_share": round(sum(idle.values()) / idle_wall, 4),
            "ttft_ms": {"narwhal": s["ttft_ms"], "direct": d["ttft_ms"], "narwhal_profiled": sp["ttft_ms"]},
            "itl_ms": {"narwhal": s["itl_ms"], "direct": d["itl_ms"]},
            "added_ttft_p50": diff(s["ttft_ms"]["p50"], d["ttft_ms"]["p50"]),
            "added_ttft_p99": diff(s["ttft_ms"]["p99"], d["ttft_ms"]["p99"]),
            "added_itl_p99": diff(s["itl_ms"]["p99"], d["itl_ms"]["p99"]),
            "tail": {"share": a.tail_share, "windows": len(windows),
                     "ttft_ms_min": round(1000 * min((b - w for w, b in windows), default=0.0), 2)},
            "by_process": {k: {"cpu_ms_per_req": round(1000 * spent.get(k, 0.0) / n, 3),
                               "load_core_share": round(share.get(k, 0.0), 3),
                               "idle_core_share": round(idle_share.get(k, 0.0), 4)} for k in labels},
            "stacks": {r.label: analyse(r, self.out, period_us, pwall, "busy samples under load", windows)
                       for r in recs if r.path.exists()},
            "idle_stacks": {r.label.removesuffix(".idle"): analyse(r, self.out, period_us, idle_rec_s,
                                                                    "busy samples with no traffic")
                            for r in idle_recs if r.path.exists()},
            "py_spy_errors": errors,
            "note": ("CPU per request and latency from a load without py-spy; stacks from the same load repeated "
                     "under py-spy (--nonblocking: its own CPU is not the router's, but it competes for the cores, "
                     "so profiled TTFTs are longer). 'busy' = samples whose innermost Python frame is not a wait "
                     "(narwhal_serve.bench.flame.WAIT_LEAVES); CPU spent in C++ threads (Ray's core worker, gRPC), "
                     "uvloop and the kernel has no Python frame, so busy % is below the /proc CPU share"),
        }


def view(res: dict[str, Any]) -> str:
    refused = f" and {res['refused']} refused" if res.get("refused") else ""
    lines = [f"load: {res['completed']} streamed requests{refused} at c={res['concurrency']}, {res['req_per_s']} req/s, "
             f"router CPU {res['cpu_ms_per_req']} ms per request; idle router {100 * res['idle_core_share']:.1f} % "
             f"of a core",
             f"added TTFT p50 / p99: {res['added_ttft_p50']} / {res['added_ttft_p99']} ms; added ITL p99 "
             f"{res['added_itl_p99']} ms; tail = slowest {res['tail']['windows']} first tokens under py-spy "
             f"(>= {res['tail']['ttft_ms_min']} ms)", ""]
    rows = []
    for k, v in res["by_process"].items():
        if v["cpu_ms_per_req"] < 0.005 and v["idle_core_share"] < 0.001:
            continue
        t = res["stacks"].get(_safe(k))
        rows.append([k, v["cpu_ms_per_req"], round(100 * v["load_core_share"], 1), round(100 * v["idle_core_share"], 2),
                     round(100 * t["busy_share"], 1) if t else "-", round(100 * t["busy_share_tail"], 1) if t else "-"])
    lines.append(table(["process", "CPU ms/req", "% core (load)", "% core (idle)", "Python busy % (load)",
                        "Python busy % (tail)"], rows))
    lines.append("\nwith no traffic, the innermost frames of each process's busy Python samples:")
    for label, st in sorted(res["idle_stacks"].items(), key=lambda kv: -kv[1]["samples"])[:8]:
        if st["samples"]:
            lines.append(f"  {label} ({100 * st['busy_share']:.1f} % of a core): "
                         + ", ".join(f"{f} {100 * x:.0f} %" for f, x in st["top_own"][:3]))
    for label, st in res["stacks"].items():
        if not st["samples"]:
            continue
        lines.append(f"\n{label} under load ({st['samples']} busy samples), innermost frames: "
                     + ", ".join(f"{f} {100 * x:.1f} %" for f, x in st["top_own"][:6]))
        if st.get("tail_lift"):
            lines.append("  during the slowest first tokens (share of busy samples there, x its share overall):")
            lines += [f"  {100 * x:5.1f} %  x{r:<5}  {f}" for f, x, r in st["tail_lift"]]
    return "\n".join(lines)


def run(a: ProfileArgs, fleet: Fleet, out: Path, runner: Any) -> dict[str, Any]:
    py_spy = _py_spy(a.py_spy)
    if py_spy is None:
        raise SystemExit("py-spy is not installed (pip install 'narwhal-serve[bench]')")
    prof = ProfileRun(a, fleet, out)
    res: dict[str, Any] = runner(prof.run(py_spy))
    res["concurrency"] = a.concurrency
    log = RequestLog(out / "requests.jsonl")
    for tags, rs in prof.log:
        log.write(tags, rs)
    write_json(out / "results.json", {"args": a.__dict__, **res})
    return res


def folded_paths(out: Path) -> list[str]:
    return sorted(str(p) for p in out.glob("*.svg"))



def add_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    pr = sub.add_parser("profile", help="py-spy over every router process under a fixed load: flame graphs, "
                                        "CPU per request per process, what runs during the slowest first tokens")
    common(pr)
    pr.add_argument("--target", default="narwhal-predictive", help="the Narwhal application profiled")
    pr.add_argument("--concurrency", type=int, default=8, help="closed-loop streaming clients")
    pr.add_argument("--duration-s", type=float, default=15.0, help="seconds of load recorded")
    pr.add_argument("--idle-s", type=float, default=10.0, help="seconds of no traffic measured first")
    pr.add_argument("--rate-hz", type=int, default=200, help="py-spy samples per second per process")
    pr.add_argument("--tail-share", type=float, default=0.01, help="the slowest share of first tokens traced")
    pr.add_argument("--min-core-share", type=float, default=0.02,
                    help="under load, py-spy only the processes that used at least this share of a core")
    pr.add_argument("--prompt-tokens", type=int, default=64)
    pr.add_argument("--output-tokens", type=int, default=16)
    pr.add_argument("--py-spy", default="", help="py-spy binary (default: next to this Python, else on PATH)")
    pr.add_argument("--ttft-target", type=float, default=None,
                    help="send X-TTFT-Target with every request: 0.001 refuses them all (the refusal path profiled)")


def main(ns: argparse.Namespace, spec: FleetSpec, runner: Any) -> int:
    if ns.target not in NARWHAL_PREFIX and base_of(ns.target) is None:
        raise SystemExit(f"--target must be one of {', '.join(NARWHAL_PREFIX)} (or one of them @base)")
    a = ProfileArgs(target=ns.target, concurrency=ns.concurrency, duration_s=ns.duration_s, idle_s=ns.idle_s,
                    rate_hz=ns.rate_hz, tail_share=ns.tail_share, min_core_share=ns.min_core_share,
                    prompt_tokens=ns.prompt_tokens, output_tokens=ns.output_tokens, api=ns.api, model=ns.model,
                    py_spy=ns.py_spy, ttft_target_s=ns.ttft_target)
    out = run_dir(ns.out, "profile")
    fleet = Fleet(spec, out / "logs")
    print(f"narwhal-bench profile: {a.target} at c={a.concurrency}; results in {out}", file=sys.stderr)
    try:
        fleet.start(["direct", a.target], ns.narwhal_start_timeout_s)
        res = run(a, fleet, out, runner)
    finally:
        fleet.stop()
    print(view(res))
    print(f"\nresults: {out / 'results.json'}")
    for p in folded_paths(out):
        print(f"flame graph: {p}")
    return 0
