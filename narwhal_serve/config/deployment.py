"""Ray Serve sizing of Narwhal's deployments (docs/operations.md, "Autoscaling")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from narwhal_serve.config.base import Strict as _Strict


# requests a relay replica takes past the router's retention limit: /ready, /metrics, /status and
# the refusals of what the limit turns away (each answered in about a millisecond)
REPLICA_HEADROOM = 256
# seconds past a request's longest life that Serve waits for a stopping relay replica before it kills it
SHUTDOWN_MARGIN_S = 10.0


class DeploymentKnobs(_Strict):
    """Ray Serve sizing of the three deployments."""

    ingress_min_replicas: int = Field(1, ge=1)
    ingress_max_replicas: int = Field(2, ge=1)
    assembler_min_replicas: int = Field(1, ge=1)
    assembler_max_replicas: int = Field(2, ge=1)
    # requests one Ingress or Assembler replica takes at once; past it Serve holds them, unanswered
    # and unseen by admission, so the default (None) is serving.http_retention_limit plus
    # REPLICA_HEADROOM: one replica takes all that Narwhal itself holds before its own 429
    max_ongoing_requests: int | None = Field(None, gt=0)
    # the HTTP stack to engines: httpx's API over aiohttp's transport, or plain httpx
    engine_http: Literal["aiohttp", "httpx"] = "aiohttp"
    # where engine streams are opened and relayed: in each ingress replica (no Ray hop per stream:
    # about half the router CPU per request, `narwhal-bench overhead`), or in the Assembler
    # deployment, a streaming Ray hop away (scaled apart from the ingress)
    relay: Literal["ingress", "assembler"] = "ingress"
    # Serve autoscaling of Ingress and Assembler (Ray Serve's AutoscalingConfig, same names): each
    # scales to keep about target_ongoing_requests requests per replica (a streaming request counts
    # until its stream ends), averaged over look_back_period_s, after the new count has held for
    # upscale_delay_s / downscale_delay_s; replicas report every metrics_interval_s (Serve's field)
    ingress_target_ongoing_requests: float = Field(64.0, gt=0)
    assembler_target_ongoing_requests: float = Field(64.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)
    metrics_interval_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _check_autoscaling(self) -> "DeploymentKnobs":
        for dep in ("ingress", "assembler"):
            lo, hi = getattr(self, f"{dep}_min_replicas"), getattr(self, f"{dep}_max_replicas")
            if lo > hi:
                raise ValueError(f"deployment.{dep}_min_replicas ({lo}) must not exceed "
                                 f"deployment.{dep}_max_replicas ({hi})")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("deployment.look_back_period_s must exceed deployment.metrics_interval_s "
                             "(Serve averages the reports inside that window)")
        return self

    def autoscaling(self, deployment: Literal["ingress", "assembler"]) -> dict[str, float | int]:
        """Ray Serve's ``autoscaling_config`` for one of the two autoscaled deployments."""
        lo, hi, target = (
            (self.ingress_min_replicas, self.ingress_max_replicas, self.ingress_target_ongoing_requests)
            if deployment == "ingress"
            else (self.assembler_min_replicas, self.assembler_max_replicas, self.assembler_target_ongoing_requests)
        )
        return {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s, "metrics_interval_s": self.metrics_interval_s}

    def relay_replica_options(self, retention_limit: int, request_timeout_s: float,
                              draining_s: float) -> tuple[int, float]:
        """Serve's per-replica options for Ingress and Assembler: ``max_ongoing_requests`` (above)
        and ``graceful_shutdown_timeout_s``: a replica Serve stops (scaling down, a redeploy, a
        replacement) drains its requests in flight, but Serve kills it this long after the stop
        (its default, 20 s, cut streams mid-answer), so it covers the direct-ingress draining
        period (``draining_s``: the replica still takes requests), then a request's longest life
        (``serving.request_timeout_s``), and a margin."""
        limit = self.max_ongoing_requests or retention_limit + REPLICA_HEADROOM
        return limit, draining_s + request_timeout_s + SHUTDOWN_MARGIN_S
