"""Serve autoscaling of Ingress and Assembler under load (docs/operations.md, "Autoscaling"): load makes Serve add
replicas of both, and less load makes it remove them again — while a client keeps streaming — with
no failed request in either direction.

A third application in the session's Ray instance (the shared ``graph`` fixture), with the
``deployment.*`` autoscaling knobs set aggressively (1 → 2 replicas each, two ongoing requests per
replica, sub-second reports, delays of 0.5 s up and 2 s down), its own simulated engine, deleted
afterwards. Replica counts are Serve's own (``serve.status()``), polled, bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from scripts.serve_replicas import snapshot
from tests.integration.conftest import MODEL, Graph
from tests.support.net import free_port_run

APP, PREFIX = "autoscale", "/autoscale"
KNOBS = {
    "ingress_min_replicas": 1, "ingress_max_replicas": 2, "ingress_target_ongoing_requests": 2,
    "assembler_min_replicas": 1, "assembler_max_replicas": 2, "assembler_target_ongoing_requests": 2,
    "upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "look_back_period_s": 2.0, "metrics_interval_s": 0.5,
    "relay": "assembler",  # both autoscaled deployments (the default relays in the ingress: no Assembler)
}
DEPLOYMENTS = ("Ingress", "Assembler")
TOKENS = 24  # × 20 ms per token: each request streams for about half a second


@pytest.fixture(scope="module")
def autoscale_url(graph: Graph) -> Iterator[str]:
    from ray import serve

    from deployments.app import build_app

    sim = free_port_run(1, start=graph.sim_base + 20)
    app = build_app({
        "model": MODEL,
        "admission": {"mode": "open"},
        "sim": {"base_port": sim, "engines": [{"name": "autoscale-unified-0", "role": "unified", "tpot_base_s": 0.02,
                                                "tpot_per_running_s": 0.0, "eos_prob": 0.0}]},
        "monitoring": {"scrape_interval_s": 0.5, "stale_after_s": 5.0},
        "deployment": KNOBS,
    })
    serve.run(app, name=APP, route_prefix=PREFIX)
    try:
        yield graph.url + PREFIX
    finally:
        serve.delete(APP)


async def _replicas() -> dict[str, dict[str, int]]:
    from ray import serve

    apps = snapshot(await asyncio.to_thread(serve.status), APP)
    deps = apps.get(APP, {}).get("deployments", {})
    return {d: dict(deps.get(d, {}).get("replicas", {})) for d in DEPLOYMENTS}


class Load:
    """Closed-loop streaming chat clients; ``clients`` can be changed while it runs."""

    def __init__(self, url: str) -> None:
        self.url = url + "/v1/chat/completions"
        self.clients = 0
        self.stop = False
        self.outcomes: list[tuple[int, str | None]] = []  # (HTTP status, what went wrong or None)

    async def _one(self, c: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": TOKENS,
                "ignore_eos": True, "stream": True}
        problem: str | None = None
        try:
            async with c.stream("POST", self.url, json=body) as r:
                status = r.status_code
                done = False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                        problem = line
                if status != 200:
                    problem = (await r.aread()).decode(errors="replace") or f"HTTP {status}"
                elif not done:
                    problem = problem or "stream ended without [DONE]"
        except httpx.HTTPError as exc:
            status, problem = 0, f"{type(exc).__name__}: {exc}"
        self.outcomes.append((status, problem))

    async def _client(self, c: httpx.AsyncClient, i: int) -> None:
        while not self.stop:
            if i < self.clients:
                await self._one(c, i)
            else:
                await asyncio.sleep(0.02)

    async def run(self, most: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as c:
            await asyncio.gather(*(self._client(c, i) for i in range(most)))


async def _wait_replicas(pred: Any, what: str, timeout_s: float, seen: list[tuple[float, Any]]) -> None:
    end = time.monotonic() + timeout_s
    while True:
        reps = await _replicas()
        seen.append((round(time.monotonic(), 1), reps))
        if pred(reps):
            return
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}; replicas seen: {seen[-12:]}")
        await asyncio.sleep(0.25)


def _at_min(reps: dict[str, dict[str, int]]) -> bool:
    return all(r.get("RUNNING", 0) == 1 and sum(r.values()) == 1 for r in reps.values())


async def test_load_scales_ingress_and_assembler_up_and_back_down_without_a_failed_request(autoscale_url: str) -> None:
    seen: list[tuple[float, Any]] = []
    async with httpx.AsyncClient(timeout=10) as c:  # the new application answers before the load starts
        end = time.monotonic() + 30
        while (await c.get(autoscale_url + "/ready")).status_code != 200:
            assert time.monotonic() < end, "the autoscale application never became ready"
            await asyncio.sleep(0.1)
    await _wait_replicas(_at_min, "one replica of each at the start", 30, seen)

    load = Load(autoscale_url)
    task = asyncio.get_running_loop().create_task(load.run(6))
    try:
        load.clients = 6  # ~6 ongoing requests against a target of 2 per replica: 3 wanted, 2 at most
        await _wait_replicas(lambda r: all(r[d].get("RUNNING", 0) == 2 for d in DEPLOYMENTS),
                             "two running replicas of Ingress and of Assembler", 45, seen)
        n_up = len(load.outcomes)
        load.clients = 1  # about one ongoing request, half the target: Serve removes a replica of each while it streams
        # (a target of 1 here would sit on the ceil(1.0 + overlap) = 2 boundary: seen in CI)
        await _wait_replicas(_at_min, "back to one replica of each", 45, seen)
        n_down = len(load.outcomes) - n_up
    finally:
        load.stop = True
        await asyncio.wait_for(task, 60)

    failed = [(s, p) for s, p in load.outcomes if p is not None]
    assert not failed, f"{len(failed)} of {len(load.outcomes)} requests failed: {failed[:5]}"
    assert n_up >= 6 and n_down >= 1, (n_up, n_down)  # requests finished while scaling up, and down
    assert all(s == 200 for s, _ in load.outcomes)
