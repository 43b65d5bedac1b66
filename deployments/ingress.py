"""Ingress deployment: the FastAPI app of :mod:`narwhal_serve.gateway` over deployment handles."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
import ray
from ray.serve.handle import DeploymentHandle

from deployments.logs import to_serve_log
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.gateway.app import build_api
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay, relay_of
from narwhal_serve.runenv import stamps_receipts
from narwhal_serve.admission.wire import LeaseGrant
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult, Report


class HandleBackend:
    """The gateway's :class:`Backend` over Ray Serve handles; engine streams relayed in this
    process (``deployment.relay: ingress``) or by the Assembler deployment."""

    def __init__(self, scheduler: DeploymentHandle, assembler: DeploymentHandle | Relay) -> None:
        self.scheduler = scheduler
        self.local = assembler if isinstance(assembler, Relay) else None
        self.assembler = None if isinstance(assembler, Relay) else assembler.options(stream=True)

    async def admit(self, req: AdmitRequest) -> AdmitResult:
        result: AdmitResult = await self.scheduler.admit.remote(req)
        return result

    async def cancel(self, ticket_id: str) -> None:
        await self.scheduler.cancel.remote(ticket_id)

    async def report(self, rep: Report) -> LeaseGrant | None:
        grant: LeaseGrant | None = await self.scheduler.report.remote(rep)
        return grant

    async def watch(self, lease_id: str) -> bool:
        call = self.scheduler.watch.remote(lease_id)
        try:
            news: bool = await call
        except asyncio.CancelledError:  # the ingress stops: its parked call ends now, not at its
            with contextlib.suppress(Exception):  # timeout (the scheduler's replica would wait for it
                call.cancel()  # to stop); best effort: an error here must not swallow the cancellation
            raise
        return news

    async def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = await self.scheduler.snapshot.remote()
        return snap

    async def metrics_text(self) -> str:
        text: str = await self.scheduler.metrics_text.remote()
        return text

    async def admin(self, op: str, arg: Any) -> Any:
        return await self.scheduler.admin.remote(op, arg)

    @property
    def local_relay(self) -> Relay | None:
        return self.local

    def relay(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        if self.local is not None:
            return self.local.run(placed)  # closing it (the client left) closes the engine connections
        return self._remote(placed)

    async def _remote(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        assert self.assembler is not None
        resp = self.assembler.run.remote(placed)
        finished = False
        try:
            async for msg in resp:
                finished = msg.final  # after the final message there is nothing left to cancel
                yield msg
            finished = True
        finally:
            if not finished:
                resp.cancel()  # the client left: the assembler closes its engine connections


class Ingress:
    def __init__(self, config: dict[str, Any], scheduler: DeploymentHandle, assembler: DeploymentHandle | None) -> None:
        to_serve_log()
        self.cfg = NarwhalConfig.model_validate(config)
        relay = assembler if assembler is not None else relay_of(self.cfg.deployment.engine_http,
                                                                 self.cfg.serving,
                                                                 self.cfg.observability, coalesce_reads=False)
        self.backend = HandleBackend(scheduler, relay)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve's proxy echoes X-Request-Id; this replica's node: placement prefers engines there;
        # in direct ingress Narwhal's HAProxy wrapper stamps each request's receipt (Serve's proxy actor does not)
        return build_api(self.cfg, self.backend, echo_request_id=False, node=ray.get_runtime_context().get_node_id(),
                         stamp_key=stamps_receipts(os.environ))
