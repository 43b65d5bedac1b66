"""The router's watch over its engines and itself: monitoring (scrapes, breakers, backpressure)
and the router lease that keeps one router active (docs/configuration.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from narwhal_serve.config.base import Strict as _Strict


class MonitoringConfig(_Strict):
    scrape_interval_s: float = Field(1.0, gt=0)
    stale_after_s: float = Field(5.0, gt=0)
    scrape_timeout_s: float = Field(2.0, gt=0)
    # Passive health: this many consecutive failed attempts (errors, broken or malformed streams,
    # first-token timeouts) open an engine's circuit breaker: no new work for breaker_open_s
    # (doubling on each reopen, at most breaker_max_open_s), then a one-token probe closes it.
    breaker_failures: int = Field(3, ge=1)
    breaker_open_s: float = Field(2.0, gt=0)
    breaker_max_open_s: float = Field(60.0, gt=0)
    # At most this fraction of the engines (at least one, never all) have an open breaker at once:
    # failures the router cannot pin on an engine must not take the whole fleet out (Envoy's
    # max_ejection_percent). A sole engine's breaker never opens.
    breaker_max_open_fraction: float = Field(0.5, gt=0, le=1)
    # An engine's 429/503 is backpressure, not a failure: no new work for its Retry-After, or
    # backpressure_s without one (at most 10 s).
    backpressure_s: float = Field(1.0, gt=0, le=10)
    # Below this fraction of engines (outside maintenance) answering their scrapes, or with the
    # monitor loop stalled, the router turns monitoring_degraded by itself (and back).
    min_fresh_fraction: float = Field(0.5, ge=0, le=1)

    @model_validator(mode="after")
    def _fresh(self) -> "MonitoringConfig":
        if self.stale_after_s <= self.scrape_interval_s:  # (every engine stale between two scrapes)
            raise ValueError("monitoring.stale_after_s must exceed monitoring.scrape_interval_s")
        return self


class LeaseConfig(_Strict):
    """The router lease (docs/operations.md, "Running two routers"): ``none`` (one router) or ``redis``."""

    backend: Literal["none", "redis"] = "none"
    url: str | None = None  # redis://host:port/db (redis backend)
    key: str = "narwhal:router"
    ttl_s: float = Field(10.0, gt=0)
    renew_s: float = Field(3.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "LeaseConfig":
        if self.backend == "none" and self.url:
            raise ValueError("ha.lease.url is given without backend: redis (set it, or the router runs "
                             "without a lease: two routers would both be active)")
        if self.backend == "redis" and not self.url:
            raise ValueError("ha.lease.url is required with backend: redis (for example redis://127.0.0.1:6379/0)")
        if self.backend == "redis" and not (self.url or "").startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"ha.lease.url {self.url!r}: a redis://, rediss:// or unix:// URL (for example "
                             "redis://127.0.0.1:6379/0)")
        if self.backend == "redis" and self.renew_s > 0.4 * self.ttl_s:
            # a lost renewal is survived: the next comes at 2 × renew_s, before the holder stops at
            # ttl_s minus its 10 % margin
            raise ValueError("ha.lease.renew_s must be at most 0.4 × ha.lease.ttl_s (one lost renewal survived)")
        return self


class HAConfig(_Strict):
    role: Literal["active", "standby"] = "active"
    lease: LeaseConfig = LeaseConfig()
