"""What the HTTP gateway needs from the rest of the router, as one small interface.

The Ray ingress implements it with deployment handles (``deployments/ingress.py``); tests and the
trace-replay tools use :class:`LocalBackend`, which runs the same services in-process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx

from narwhal_serve.config import EngineConfig
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report
from narwhal_serve.scheduler.service import SchedulerService


class Backend(Protocol):
    async def admit(self, req: AdmitRequest) -> AdmitResult: ...

    async def cancel(self, ticket_id: str) -> None: ...

    async def report(self, rep: Report) -> None: ...

    async def snapshot(self) -> dict[str, Any]: ...

    async def metrics_text(self) -> str: ...

    async def admin(self, op: str, arg: Any) -> Any: ...

    def relay(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]: ...


async def admin_op(svc: SchedulerService, op: str, arg: Any) -> Any:
    """The scheduler's admin surface, shared by every backend."""
    if op == "maintenance_on":
        return svc.maintenance(list(arg), True)
    if op == "maintenance_off":
        return svc.maintenance(list(arg), False)
    if op == "register":
        svc.register_engine(EngineConfig.model_validate(arg))
        return True
    if op == "deregister":
        return svc.deregister_engine(str(arg))
    if op == "set_mode":
        svc.set_mode(str(arg))
        return True
    if op == "scrape":
        await svc.scrape_once()
        return True
    raise ValueError(f"unknown admin op {op!r}")


class LocalBackend:
    def __init__(self, svc: SchedulerService, client: httpx.AsyncClient) -> None:
        self.svc = svc
        self.relay_ = Relay(client)

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

    def relay(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        return self.relay_.run(placed)
