"""ManagedEngine deployment: each replica supervises one engine process (docs/operations.md, "Managed engines").

The replica starts the engine on a free port of its node, is ready only once the engine's /health
answers, reports it to the scheduler (and keeps reporting: a heartbeat), tells the scheduler at once
when the process exits and then fails Serve's health check (Serve replaces the replica: a new engine
process), and stops the engine's whole process group with the replica.  The logic is
:mod:`narwhal_serve.managed`; this file only gathers what Ray knows (node, accelerators, replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.logs import to_serve_log
from narwhal_serve.config import EngineConfig
from narwhal_serve.managed.command import (
    HEALTH_HTTP_TIMEOUT_S,
    engine_argv,
    engine_env,
    guard_prefix,
    kv_event_endpoints,
    kv_events_wanted,
    url_host,
)
from narwhal_serve.managed.process import EngineProcess
from narwhal_serve.managed.slot import HEARTBEAT_S, ReplicaReport
from narwhal_serve.config.launch import LaunchSpec
from narwhal_serve.ports import free_port, ipc_paths

SCHEDULER = "Scheduler"  # the scheduler's deployment name (build_app)
# through the replica's log handler (to_serve_log), not Serve's own logger: in throughput mode that
# holds records in a buffer written when full, and this replica logs a few lines a day
log = logging.getLogger("narwhal.managed")
log.setLevel(logging.INFO)  # (its "ready" line too; the rest of narwhal.* logs warnings and above)


def _bundle_probe() -> tuple[str, list[str]]:
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), [str(i) for i in ctx.get_accelerator_ids().get("GPU", [])]


async def _accelerators(spec: LaunchSpec, node_id: str, engine: str) -> list[str]:
    """The GPUs the engine may use: the replica's own, and with tensor parallelism those of the
    other bundles of its placement group (a zero-CPU task in each bundle reads them)."""
    own = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    pg = ray.util.get_current_placement_group()
    if not spec.uses_placement_group or pg is None:
        return own
    probe = ray.remote(_bundle_probe)
    refs = [
        probe.options(num_cpus=0, num_gpus=spec.gpus_per_worker, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i, placement_group_capture_child_tasks=False)).remote()
        for i in range(1, spec.tensor_parallel_size)
    ]
    ids = list(own)
    for i, (node, gpus) in enumerate(await asyncio.gather(*refs), start=1):
        if node != node_id:
            raise RuntimeError(
                f"engine {engine}: tensor-parallel bundle {i} was placed on node {node}, not on the replica's "
                f"node {node_id}; an engine process can only use its own node's GPUs "
                f"(launch.placement_strategy: STRICT_PACK keeps them together)")
        ids += gpus
    return ids


class ManagedEngine:
    async def __init__(self, engine: dict[str, Any], model: str) -> None:
        to_serve_log()
        self.cfg = EngineConfig.model_validate(engine)
        spec = self.cfg.launch
        if spec is None:
            raise ValueError(f"engine {self.cfg.name!r} has no launch spec")
        self.spec = spec
        ctx = serve.get_replica_context()
        self.replica, self.app = ctx.replica_tag, ctx.app_name
        node_id = ray.get_runtime_context().get_node_id()
        node_ip = ray.util.get_node_ip_address()
        gpus = await _accelerators(spec, node_id, self.cfg.name)
        host = spec.host or node_ip
        port = free_port(host)
        self.url = f"http://{url_host(host, node_ip)}:{port}"
        kv_bind = kv_reach = None
        if kv_events_wanted(spec):
            kv_bind, kv_reach = kv_event_endpoints(host, node_ip, (free_port(host), free_port(host)),
                                                   secrets.token_hex(8))
        argv = engine_argv(spec, name=self.cfg.name, model=model, role=self.cfg.role, dialect=self.cfg.dialect,
                           host=host, port=port, python=spec.interpreter(sys.executable), kv_events=kv_bind,
                           priority=self.cfg.priority_scheduling)
        env = engine_env(spec, os.environ, current_python=sys.executable, gpu_ids=gpus)
        log_dir = Path(spec.log_dir) if spec.log_dir else Path(tempfile.gettempdir()) / "narwhal-engines"
        log_path = log_dir / f"{self.app}-{self.cfg.name}-{self.replica}.log"
        self.proc = EngineProcess(self.cfg.name, argv, env, log_path, prefix=guard_prefix(os.getpid(), sys.executable),
                                  leftovers=ipc_paths(kv_bind or ()))
        self._scheduler: DeploymentHandle | None = None
        self._tasks: list[asyncio.Task[None]] = []
        await self.proc.start()
        try:
            ready_s = await self.proc.wait_ready(self.url, spec.ready_timeout_s)
        except BaseException:
            await self.proc.stop(spec.stop_grace_s)
            raise
        self.report = ReplicaReport(
            engine=self.cfg.name, replica=self.replica, url=self.url, node_id=node_id, node_ip=node_ip,
            accelerator_ids=tuple(gpus), pid=self.proc.pid or 0, log=str(log_path), ready_s=ready_s,
            kv_events=kv_reach,
        )
        log.info("managed engine %s ready at %s after %.1f s (pid %s, node %s, accelerators %s, log %s)",
                 self.cfg.name, self.url, ready_s, self.proc.pid, node_ip, gpus or "none", log_path)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat()), loop.create_task(self._watch())]

    async def _handle(self) -> DeploymentHandle:
        if self._scheduler is None:
            # by name: the scheduler cannot be bound here (it binds the engines, so Serve deploys them)
            self._scheduler = await asyncio.to_thread(serve.get_deployment_handle, SCHEDULER, self.app)
        return self._scheduler

    async def _heartbeat(self) -> None:
        while True:
            try:
                await (await self._handle()).register_managed.remote(self.report)
            except Exception as exc:  # the scheduler restarting: the next beat registers again
                log.warning("managed engine %s: report to the scheduler failed: %r", self.cfg.name, exc)
            await asyncio.sleep(HEARTBEAT_S)

    async def _watch(self) -> None:
        """When the engine process exits: no more heartbeats, the scheduler told at once, the rest
        of its process group stopped; Serve's next health checks fail and it replaces this replica."""
        await self.proc.wait_exit()
        self._tasks[0].cancel()
        why = self.proc.describe_exit()
        log.warning("managed engine %s: %s; Serve will replace this replica (log %s)", self.cfg.name, why,
                    self.proc.log_path)
        await self.proc.stop(0.0)
        await self._tell_down(why)

    async def _tell_down(self, why: str) -> None:
        try:
            async with asyncio.timeout(5.0):
                await (await self._handle()).managed_down.remote(self.cfg.name, self.replica, why)
        except Exception as exc:  # its next scrape finds the engine gone anyway
            log.warning("managed engine %s: could not tell the scheduler it is down: %r", self.cfg.name, exc)

    async def check_health(self) -> None:
        await self.proc.check(self.url, HEALTH_HTTP_TIMEOUT_S)

    async def info(self) -> dict[str, Any]:
        return {**asdict(self.report), "alive": self.proc.alive()}

    async def __del__(self) -> None:
        for t in getattr(self, "_tasks", ()):
            t.cancel()
        if not hasattr(self, "report"):  # the constructor failed: it stopped its engine itself
            return
        # the scheduler first: it stops placing requests here before the engine, signalled, aborts them
        if self.proc.alive():
            with contextlib.suppress(Exception):
                await self._tell_down("stopped with its replica")
        await self.proc.stop(self.spec.stop_grace_s)
