"""Engine health and /metrics scraping: one pass over every engine, concurrently."""

from __future__ import annotations

import asyncio

import httpx

from narwhal_serve.engines.metrics import parse_engine_metrics
from narwhal_serve.placement.engines import EngineState


async def scrape_one(client: httpx.AsyncClient, e: EngineState, now: float, timeout_s: float) -> None:
    base = e.cfg.base_url
    try:
        health, metrics = await asyncio.gather(
            client.get(base + "/health", timeout=timeout_s),
            client.get(base + "/metrics", timeout=timeout_s),
        )
    except (httpx.HTTPError, OSError):
        e.healthy = False
        e.failures += 1
        return
    e.healthy = health.status_code == 200
    if e.healthy and metrics.status_code == 200:
        e.load = parse_engine_metrics(metrics.text)
        e.inflight_at_scrape = e.inflight
        e.max_running_seen = max(e.max_running_seen, int(e.load.running))
        e.last_ok = now
        e.failures = 0
    else:
        e.failures += 1


async def scrape_all(
    client: httpx.AsyncClient, engines: list[EngineState], now: float, timeout_s: float
) -> None:
    await asyncio.gather(*(scrape_one(client, e, now, timeout_s) for e in engines))
