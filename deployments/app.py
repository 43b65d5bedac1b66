"""build_app(args) -> Application: validates the typed args and binds the graph (SPEC §1).

    client → Ingress (FastAPI, autoscaled) ─admit─▶ Scheduler (1 replica) ─scrape─▶ engines
                    └─────── stream ───────▶ Assembler (autoscaled) ──HTTP──▶ engines
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from deployments.assembler import Assembler
from deployments.ingress import Ingress
from deployments.scheduler import Scheduler
from deployments.simfleet import SimFleet
from narwhal_serve.config import NarwhalConfig, format_validation_error


def build_app(args: dict[str, Any]) -> Application:
    try:
        cfg = NarwhalConfig.model_validate(args or {})
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc)) from None
    conf = cfg.model_dump(mode="json")
    knobs = cfg.deployment
    free = {"num_cpus": 0}
    quiet = {"enable_access_log": False}  # internal hops: Serve's per-call access log costs CPU on each
    scheduler_dep = serve.deployment(
        Scheduler, name="Scheduler", num_replicas=1, max_ongoing_requests=100_000, ray_actor_options=free,
        logging_config=quiet,
    )
    assembler_dep = serve.deployment(
        Assembler,
        name="Assembler",
        max_ongoing_requests=knobs.max_ongoing_requests,
        autoscaling_config=knobs.autoscaling("assembler"),
        ray_actor_options=free,
        logging_config=quiet,
    )
    ingress_dep = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        max_ongoing_requests=knobs.max_ongoing_requests,
        autoscaling_config=knobs.autoscaling("ingress"),
        ray_actor_options=free,
    )
    fleet = None
    if not cfg.engines:
        fleet = serve.deployment(SimFleet, name="SimFleet", num_replicas=1, max_ongoing_requests=100,
                                 ray_actor_options=free).bind(conf)
    scheduler = scheduler_dep.bind(conf, fleet)
    assembler = assembler_dep.bind(knobs.engine_http, cfg.serving.engine_idle_timeout_s, cfg.observability.model_dump())
    return ingress_dep.bind(conf, scheduler, assembler)
