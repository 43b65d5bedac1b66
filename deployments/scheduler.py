"""Scheduler deployment (exactly one replica): forwards to :class:`SchedulerService`."""

from __future__ import annotations

from typing import Any

from ray.serve.handle import DeploymentHandle

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.gateway.backend import admin_op
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report
from narwhal_serve.scheduler.service import SchedulerService


class Scheduler:
    async def __init__(self, config: dict[str, Any], sim_fleet: DeploymentHandle | None = None) -> None:
        self.svc = SchedulerService(NarwhalConfig.model_validate(config))
        if sim_fleet is not None:
            await sim_fleet.ready.remote()  # the embedded fleet answers before the first scrape
        await self.svc.scrape_once()
        self.svc.start()

    async def admit(self, req: AdmitRequest) -> AdmitResult:
        return await self.svc.admit(req)

    async def cancel(self, ticket_id: str) -> None:
        self.svc.cancel(ticket_id)

    async def report(self, rep: Report) -> None:
        self.svc.report(rep)

    async def snapshot(self) -> dict[str, Any]:
        return self.svc.snapshot()

    async def metrics_text(self) -> str:
        return self.svc.metrics_text()

    async def admin(self, op: str, arg: Any) -> Any:
        return await admin_op(self.svc, op, arg)
