"""The arguments of ``narwhal-bench ramp`` and ``soak`` (:mod:`.cli`): their parsers, and the
parsed namespace turned into each run's frozen arguments."""


from __future__ import annotations

import argparse
from pathlib import Path

from narwhal_serve.bench import ramp, soak_mix


def key_value(s: str) -> tuple[str, str]:
    key, sep, value = s.partition("=")
    if not sep or not key:
        raise SystemExit(f"--ray-env wants KEY=VALUE, got {s!r}")
    return key, value


def _min_max(s: str) -> tuple[int, int]:
    lo, sep, hi = s.partition(",")
    if not sep:
        raise argparse.ArgumentTypeError(f"want MIN,MAX, got {s!r}")
    return int(lo), int(hi)


def ramp_parser(r: argparse.ArgumentParser) -> None:
    d, k = ramp.RampArgs(), ramp.default_knobs()
    r.add_argument("--out", type=Path, default=Path("bench-results"), help="results folder (default %(default)s)")
    r.add_argument("--peak", type=int, default=d.peak, help="clients at the top of the ramp (default %(default)s)")
    r.add_argument("--ramp-up-s", type=float, default=d.ramp_up_s)
    r.add_argument("--hold-s", type=float, default=d.hold_s)
    r.add_argument("--ramp-down-s", type=float, default=d.ramp_down_s)
    r.add_argument("--step-s", type=float, default=d.step_s, help="seconds between client-count changes")
    r.add_argument("--baseline-s", type=float, default=d.baseline_s)
    r.add_argument("--settle-timeout-s", type=float, default=d.settle_timeout_s,
                   help="after the load: wait at most this long for the replicas to return to the minimum")
    r.add_argument("--sample-interval-s", type=float, default=d.sample_interval_s)
    r.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    r.add_argument("--output-tokens", type=int, default=d.output_tokens)
    r.add_argument("--tpot-s", type=float, default=d.tpot_s, help="simulated seconds per output token")
    r.add_argument("--engines", type=int, default=d.engines, help="embedded simulated engines (unified)")
    r.add_argument("--admission", choices=["predictive", "open"], default=d.admission)
    r.add_argument("--api", choices=["chat", "completions"], default=d.api)
    a = r.add_argument_group("autoscaling (the config's deployment.* knobs)")
    a.add_argument("--ingress-replicas", type=_min_max,
                   default=(k["ingress_min_replicas"], k["ingress_max_replicas"]), help="MIN,MAX (default 1,3)")
    a.add_argument("--assembler-replicas", type=_min_max,
                   default=(k["assembler_min_replicas"], k["assembler_max_replicas"]), help="MIN,MAX (default 1,3)")
    a.add_argument("--target-ongoing", type=float, default=k["ingress_target_ongoing_requests"],
                   help="target_ongoing_requests of both deployments (default %(default)s)")
    for name in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s", "metrics_interval_s"):
        a.add_argument("--" + name.replace("_", "-"), type=float, default=k[name], help="default %(default)s")
    r.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for `serve run` (repeatable), e.g. RAY_SERVE_ENABLE_HA_PROXY=0")
    r.add_argument("--narwhal-start-timeout-s", type=float, default=d.start_timeout_s)


def soak_parser(s: argparse.ArgumentParser) -> None:
    d = soak_mix.SoakArgs()
    s.add_argument("--minutes", type=float, default=d.minutes, help="length of the load (default %(default)s)")
    s.add_argument("--concurrency", type=int, default=d.concurrency, help="closed-loop clients (default %(default)s)")
    s.add_argument("--think-s", type=float, default=d.think_s,
                   help="mean pause of a client between requests, exponential (default %(default)s)")
    s.add_argument("--sample-s", type=float, default=d.sample_s, help="RSS sampling interval (default %(default)s)")
    s.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="results folder (soak-<time>/results.json in it; default %(default)s) or a .json path")
    s.add_argument("--fault-rate", type=float, default=d.fault_rate,
                   help="share of requests with a simulator fault (default %(default)s)")
    s.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate,
                   help="share of clients leaving mid-stream or before headers (default %(default)s)")
    s.add_argument("--malformed-rate", type=float, default=d.malformed_rate,
                   help="share of malformed or cut-short bodies (default %(default)s)")
    s.add_argument("--engine-fault-every-s", type=float, default=d.engine_fault_every_s,
                   help="an engine-wide fault every this many seconds, 0 for none (default %(default)s)")
    s.add_argument("--engine-fault-s", type=float, default=d.engine_fault_s,
                   help="length of one engine-wide fault (default %(default)s)")
    s.add_argument("--baseline-s", type=float, default=d.baseline_s,
                   help="RSS growth is measured from the first sample at or after this (default: 10%% of the load)")
    s.add_argument("--max-growth-pct", type=float, default=d.max_growth_pct,
                   help="a Narwhal role growing this much or more fails the run (default %(default)s)")
    s.add_argument("--quiesce-timeout-s", type=float, default=d.quiesce_timeout_s,
                   help="after the load: wait at most this long for the books to close (default %(default)s)")
    s.add_argument("--seed", type=int, default=d.seed)
    s.add_argument("--model", default=d.model)
    s.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the run (repeatable), e.g. RAY_SERVE_ENABLE_HA_PROXY=0")
    s.add_argument("--narwhal-start-timeout-s", type=float, default=d.start_timeout_s)


def soak_args(ns: argparse.Namespace) -> soak_mix.SoakArgs:
    try:
        return soak_mix.SoakArgs(minutes=ns.minutes, concurrency=ns.concurrency, think_s=ns.think_s,
                             sample_s=ns.sample_s, fault_rate=ns.fault_rate, disconnect_rate=ns.disconnect_rate,
                             malformed_rate=ns.malformed_rate, engine_fault_every_s=ns.engine_fault_every_s,
                             engine_fault_s=ns.engine_fault_s, baseline_s=ns.baseline_s,
                             max_growth_pct=ns.max_growth_pct, quiesce_timeout_s=ns.quiesce_timeout_s,
                             model=ns.model, seed=ns.seed, ray_env=tuple(key_value(kv) for kv in ns.ray_env),
                             start_timeout_s=ns.narwhal_start_timeout_s)
    except ValueError as exc:
        raise SystemExit(f"narwhal-bench soak: {exc}") from None


def ramp_args(ns: argparse.Namespace) -> ramp.RampArgs:
    knobs = {"ingress_min_replicas": ns.ingress_replicas[0], "ingress_max_replicas": ns.ingress_replicas[1],
             "ingress_target_ongoing_requests": ns.target_ongoing,
             "assembler_min_replicas": ns.assembler_replicas[0], "assembler_max_replicas": ns.assembler_replicas[1],
             "assembler_target_ongoing_requests": ns.target_ongoing,
             **{n: getattr(ns, n) for n in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s",
                                             "metrics_interval_s")}}
    return ramp.RampArgs(peak=ns.peak, ramp_up_s=ns.ramp_up_s, hold_s=ns.hold_s, ramp_down_s=ns.ramp_down_s,
                         step_s=ns.step_s, baseline_s=ns.baseline_s, settle_timeout_s=ns.settle_timeout_s,
                         sample_interval_s=ns.sample_interval_s, prompt_tokens=ns.prompt_tokens,
                         output_tokens=ns.output_tokens, tpot_s=ns.tpot_s, engines=ns.engines,
                         admission=ns.admission, api=ns.api, knobs=knobs,
                         ray_env=tuple(key_value(kv) for kv in ns.ray_env),
                         start_timeout_s=ns.narwhal_start_timeout_s)
