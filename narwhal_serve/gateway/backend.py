"""What the HTTP gateway needs from the rest of the router, as one small interface.

The Ray ingress implements it with deployment handles (``deployments/ingress.py``); tests and the
trace-replay tools use :class:`LocalBackend`, which runs the same services in-process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx

from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from narwhal_serve.scheduler.api import SchedulerApi
from narwhal_serve.admission.wire import LeaseGrant
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report
from narwhal_serve.scheduler.service import SchedulerService


class Backend(Protocol):
    async def admit(self, req: AdmitRequest) -> AdmitResult: ...

    async def cancel(self, ticket_id: str) -> None: ...

    async def report(self, rep: Report) -> LeaseGrant | None: ...

    async def watch(self, lease_id: str) -> bool:
        """Parked until another holder placed requests this lease has not heard of (True), or a
        while without (False): scheduler/watch.py."""
        ...

    async def snapshot(self) -> dict[str, Any]: ...

    async def metrics_text(self) -> str: ...

    async def admin(self, op: str, arg: Any) -> Any: ...

    def relay(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]: ...

    @property
    def local_relay(self) -> Relay | None:
        """The relay when it runs in this process (it can read this ingress's lease view)."""
        ...


class LocalBackend(SchedulerApi):
    def __init__(self, svc: SchedulerService, client: httpx.AsyncClient) -> None:
        self.svc = svc
        # as in an ingress replica (deployment.relay: ingress): no coalescing for a Ray hop
        self.relay_ = Relay.configured(client, svc.cfg.serving, svc.cfg.observability, coalesce_reads=False)

    def relay(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        return self.relay_.run(placed)

    @property
    def local_relay(self) -> Relay | None:
        return self.relay_
