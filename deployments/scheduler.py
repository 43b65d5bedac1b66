"""Scheduler deployment (exactly one replica): the :class:`SchedulerApi` over one service."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.serve.handle import DeploymentHandle

from deployments.kvshard import HandleLink
from deployments.logs import to_serve_log
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.scheduler.api import SchedulerApi
from narwhal_serve.scheduler.service import SchedulerService


class Scheduler(SchedulerApi):
    async def __init__(
        self, config: dict[str, Any], sim_fleet: DeploymentHandle | None = None, *engines: DeploymentHandle,
        kv_shards: Sequence[DeploymentHandle] = (),
    ) -> None:
        to_serve_log()
        # ``engines``: the managed engines' deployments, bound here only so that Serve deploys them
        # with the app; never awaited (they start in their own time and report here when up)
        self.engines = engines
        # ``kv_shards``: the KV-event shards' deployments (placement.kv_event_shards), one per slice of engines
        self.svc = SchedulerService(NarwhalConfig.model_validate(config), kv_shards=[HandleLink(h) for h in kv_shards])
        if sim_fleet is not None:
            await sim_fleet.ready.remote()  # the embedded fleet answers before the first scrape
        await self.svc.scrape_once()
        self.svc.start()

    async def __del__(self) -> None:
        await self.svc.stop()  # a clean stop hands the router lease over at once
