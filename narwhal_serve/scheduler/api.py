"""The scheduler's call surface, as both the Ray deployment and the in-process backend expose it."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from narwhal_serve.config import EngineConfig
from narwhal_serve.managed.slot import ReplicaReport
from narwhal_serve.admission.wire import LeaseGrant
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report
from narwhal_serve.scheduler.service import SchedulerService


class SchedulerApi:
    svc: SchedulerService

    async def admit(self, req: AdmitRequest) -> AdmitResult:
        return await self.svc.admit(req)

    async def cancel(self, ticket_id: str) -> None:
        self.svc.cancel(ticket_id)

    async def report(self, rep: Report) -> LeaseGrant | None:
        return self.svc.report(rep)

    async def watch(self, lease_id: str) -> bool:
        return await self.svc.watch(lease_id)

    async def snapshot(self) -> dict[str, Any]:
        return self.svc.snapshot()

    async def metrics_text(self) -> str:
        return self.svc.metrics_text()

    async def register_managed(self, rep: ReplicaReport) -> str:
        """A managed engine's replica: its engine answers /health (repeated as a heartbeat)."""
        return self.svc.register_managed(rep)

    async def managed_down(self, engine: str, replica: str, reason: str) -> None:
        """A managed engine's replica: its engine process ended."""
        self.svc.managed_down(engine, replica, reason)

    async def admin(self, op: str, arg: Any) -> Any:
        svc = self.svc
        if op == "maintenance_on":
            return svc.maintenance(list(arg), True)
        if op == "maintenance_off":
            return svc.maintenance(list(arg), False)
        if op == "register":
            try:
                engine = EngineConfig.model_validate(arg)
            except ValidationError as exc:  # (its fields named, not pydantic's dump: found by a hostile probe)
                raise ValueError("engine: " + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
                                                       for e in exc.errors(include_url=False))) from None
            svc.register_engine(engine)
            return True
        if op == "deregister":
            return svc.deregister_engine(str(arg))
        if op == "drain":
            until = svc.drain(float(arg), time.time())
            await svc.ha.release()  # under a router lease: the standby takes over once its ingress leases end
            return until
        if op == "set_mode":
            svc.set_mode(str(arg))
            return True
        if op == "scrape":
            await svc.scrape_once()
            return True
        raise ValueError(f"unknown admin op {op!r}")
