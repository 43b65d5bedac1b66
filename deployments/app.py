"""build_app(args) -> Application: validates the typed args and binds the graph (README, "Shape").

    client → Ingress (FastAPI, autoscaled) ─lease/report─▶ Scheduler (1 replica) ─scrape─▶ engines
                    └──────────────── HTTP (relay in the ingress) ────────────────▶ engines
             or     └── stream ──▶ Assembler (autoscaled; deployment.relay: assembler) ──HTTP──▶ engines
    Scheduler ◀─changes─ KVEventShard0..N-1 (placement.kv_event_shards) ◀─KV events (ZMQ)─ engines
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from deployments.assembler import Assembler
from deployments.engine import SCHEDULER, ManagedEngine
from deployments.ingress import Ingress
from deployments.kvshard import KVEventShard
from deployments.scheduler import Scheduler
from deployments.simfleet import SimFleet
from narwhal_serve.config import NarwhalConfig, format_validation_error
from narwhal_serve.managed.command import deployment_names, deployment_options
from narwhal_serve.tokenization.sizer import tokenizer_path


def build_app(args: dict[str, Any]) -> Application:
    try:
        cfg = NarwhalConfig.model_validate(args or {})
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc)) from None
    cfg = _resolve_launch_paths(cfg, Path.cwd())
    conf = cfg.model_dump(mode="json")
    knobs = cfg.deployment
    free = {"num_cpus": 0}
    quiet = {"enable_access_log": False}  # internal hops: Serve's per-call access log costs CPU on each
    # (Ray's default draining period when the run sets none: scripts/serve_run.py sets 5 s)
    draining_s = float(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "30"))
    ongoing, shutdown_s = knobs.relay_replica_options(cfg.serving.http_retention_limit, cfg.serving.request_timeout_s,
                                                      draining_s)
    scheduler_dep = serve.deployment(
        Scheduler, name=SCHEDULER, num_replicas=1, max_ongoing_requests=100_000, ray_actor_options=free,
        logging_config=quiet,
    )
    assembler_dep = None if knobs.relay == "ingress" else serve.deployment(
        Assembler,
        name="Assembler",
        max_ongoing_requests=ongoing,
        graceful_shutdown_timeout_s=shutdown_s,
        autoscaling_config=knobs.autoscaling("assembler"),
        ray_actor_options=free,
        logging_config=quiet,
    )
    ingress_dep = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        max_ongoing_requests=ongoing,
        graceful_shutdown_timeout_s=shutdown_s,
        autoscaling_config=knobs.autoscaling("ingress"),
        ray_actor_options=free,
    )
    fleet = None
    if not cfg.engines:
        fleet = serve.deployment(SimFleet, name="SimFleet", num_replicas=1, max_ongoing_requests=100,
                                 ray_actor_options=free).bind(conf)
    # Managed engines (docs/operations.md, "Managed engines"): one deployment each, bound into the scheduler so
    # that Serve deploys them; their replicas find the scheduler by name and report to it.
    managed = [e for e in cfg.engines if e.launch is not None]
    engines = [
        serve.deployment(ManagedEngine, name=dep_name, logging_config=quiet, **deployment_options(e.launch))
        .bind(e.model_dump(mode="json"), cfg.model)
        for e, dep_name in zip(managed, deployment_names([e.name for e in managed]))
        if e.launch is not None
    ]
    pl = cfg.placement
    shards = [
        serve.deployment(KVEventShard, name=f"KVEventShard{i}", num_replicas=1, max_ongoing_requests=100_000,
                         ray_actor_options=free, logging_config=quiet).bind(pl.prefix_block_tokens,
                                                                            max_blocks=pl.prefix_max_blocks)
        for i in range(pl.kv_event_shards if pl.prefix_aware else 0)
    ]
    scheduler = scheduler_dep.bind(conf, fleet, *engines, kv_shards=shards)
    assembler = None if assembler_dep is None else assembler_dep.bind(
        knobs.engine_http, cfg.serving.model_dump(), cfg.observability.model_dump(), tokenizer_path(cfg))
    return ingress_dep.bind(conf, scheduler, assembler)


def _resolve_launch_paths(cfg: NarwhalConfig, base: Path) -> NarwhalConfig:
    """Launch specs' relative paths made absolute against the directory ``serve run`` started in."""
    if not any(e.launch is not None for e in cfg.engines):
        return cfg
    engines = tuple(e.model_copy(update={"launch": e.launch.resolved(base)}) if e.launch is not None else e
                    for e in cfg.engines)
    return cfg.model_copy(update={"engines": engines})
