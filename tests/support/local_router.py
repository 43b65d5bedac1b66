"""The whole router in-process, without Ray: sims + SchedulerService + gateway on uvicorn."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.gateway.app import build_api
from narwhal_serve.gateway.backend import LocalBackend
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.kvevents.shard import ShardLink
from narwhal_serve.scheduler.service import SchedulerService
from narwhal_serve.sim.server import SimServer, start_server
from tests.support.net import free_port, free_port_run


TEST_STAMP_KEY = "0123456789abcdef" * 2  # the key of the receipt stamps a stamped router believes


@dataclass
class LocalRouter:
    url: str
    cfg: NarwhalConfig
    svc: SchedulerService
    sims: list[SimServer]
    server: uvicorn.Server
    task: "asyncio.Task[None]"
    client: httpx.AsyncClient
    app_reporter: Reporter

    def sim(self, name: str) -> SimServer:
        return next(s for s in self.sims if s.engine.cfg.name == name)

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task
        await self.app_reporter.stop()  # (its lease renewals went on reporting to the stopped scheduler)
        await self.svc.stop()
        await self.client.aclose()
        for s in self.sims:
            await s.stop()


async def start_local_router(args: dict[str, Any], kv_shards: Sequence[ShardLink] = (), *,
                             stamped: bool = False) -> LocalRouter:
    """The router in this process over simulated engines; ``stamped``: as behind HAProxy, which stamps
    each request's receipt (its ``x-narwhal-received-us`` header is believed, with TEST_STAMP_KEY)."""
    base = free_port_run(len(NarwhalConfig.model_validate(args).sim.engines))
    cfg = NarwhalConfig.model_validate({**args, "sim": {**args.get("sim", {}), "base_port": base}})
    sims = [await start_server(e, cfg.sim.host, cfg.sim.base_port + i) for i, e in enumerate(cfg.sim_engine_configs())]
    svc = SchedulerService(cfg, kv_shards=kv_shards)
    await svc.scrape_once()
    svc.start()
    client = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None))
    app = build_api(cfg, LocalBackend(svc, client), stamp_key=TEST_STAMP_KEY if stamped else None)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.get_running_loop().create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    return LocalRouter(f"http://127.0.0.1:{port}", cfg, svc, sims, server, task, client, app.state.reporter)
