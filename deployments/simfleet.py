"""The embedded simulated fleet (docs/testing.md, "Simulator"): one HTTP server per simulated engine, in one replica."""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.logs import to_serve_log
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.sim.server import SimServer, start_server


class SimFleet:
    async def __init__(self, config: dict[str, Any]) -> None:
        to_serve_log()
        cfg = NarwhalConfig.model_validate(config)
        self.servers: list[SimServer] = []
        for i, engine_cfg in enumerate(cfg.sim_engine_configs()):
            self.servers.append(await start_server(engine_cfg, cfg.sim.host, cfg.sim.base_port + i))

    async def ready(self) -> list[str]:
        return [s.url for s in self.servers]

    async def __del__(self) -> None:
        """The replica stopping: its engines stop with it (hanging requests released, their KV-event
        sockets closed and their files removed)."""
        await asyncio.gather(*(s.stop() for s in getattr(self, "servers", ())), return_exceptions=True)
