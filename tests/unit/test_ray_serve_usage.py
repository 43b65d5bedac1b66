"""How Narwhal uses Ray Serve 2.60, checked against Ray's own source (a differential review).

Every test here failed before its fix and names the Ray source it rests on (each docstring says
what was wrong). None starts Ray:
each reads what Narwhal hands Serve (deployment options, the run environment, the ASGI lifespan,
the log handlers) and compares it with what Serve 2.60 then does.
"""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narwhal_serve.config import NarwhalConfig, ServingConfig
from narwhal_serve.runenv import RUN_ENV, IngressLimits, direct_ingress_env

# Ray 2.60's defaults for the values below (ray/serve/_private/constants.py), as the run command
# leaves them (it sets none of these variables).
RAY_HAPROXY_HARD_STOP_AFTER_S = 120  # constants.py:803-805
RAY_HAPROXY_MAXCONN = 4096  # constants.py:771
# scripts/serve_run.py ENV_DEFAULTS: the run mode's direct-ingress draining period
RUN_MIN_DRAINING_PERIOD_S = 5.0
RAY_DIRECT_INGRESS_SHUTDOWN_BUFFER_S = 5.0  # constants.py:1086


def _run_env() -> dict[str, str]:
    """The environment `make run` gives Ray (scripts/serve_run.py build_env, without its temp dirs)."""
    return {**RUN_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(RUN_MIN_DRAINING_PERIOD_S)}


# ---------------------------------------------------------------------------------------------------
# 1. HAProxy's hard-stop-after (120 s) cuts every stream older than that at each HAProxy reload


def test_haproxy_hard_stop_after_outlasts_the_longest_request(tmp_path: Path) -> None:
    """Serve reloads HAProxy (a new process with ``-sf <old pid>``) whenever the set of ingress
    replicas changes: an autoscaling step, a replica replaced (ray/serve/_private/haproxy.py
    ``_update_haproxy_backends`` -> ``_reload_haproxy`` -> ``_graceful_reload``, 1148-1195). The old
    process keeps the connections it holds only until ``hard-stop-after`` (haproxy_templates.py 82,
    ``RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S``, default 120 s, constants.py 803), then kills them
    (upstream: ray-project/ray#66056, PR #63996: ``KH--`` kills at exactly hard-stop-after). Narwhal
    lets a request run ``serving.request_timeout_s`` (600 s) and sizes HAProxy's client timeout so
    that "HAProxy never cuts what the router still handles" (runenv.py, docs/operations.md), but
    leaves hard-stop-after at 120 s: a stream still running 120 s after an ingress scale step is cut
    with no error event and no ``[DONE]``. Expected: the run environment raises it past the longest
    request (as it does the client timeout)."""
    limits = IngressLimits.of([ServingConfig()])
    env = direct_ingress_env(_run_env(), limits, str(tmp_path))
    hard_stop = int(env.get("RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S", RAY_HAPROXY_HARD_STOP_AFTER_S))
    longest = ServingConfig().request_timeout_s
    assert hard_stop >= longest, (
        f"HAProxy kills a reloaded-out worker's connections {hard_stop} s after each reload; a request may "
        f"run {longest:.0f} s (serving.request_timeout_s)")


# ---------------------------------------------------------------------------------------------------
# 2. graceful_shutdown_timeout_s left at Serve's 20 s: a replica stopped by autoscaling or a redeploy
#    is force-killed under its streams


def _deployments(args: dict[str, Any]) -> dict[str, Any]:
    from deployments.app import build_app  # (imports ray.serve; starts nothing)

    app = build_app(args)
    ingress = app._bound_deployment
    out = {ingress.name: ingress}
    for arg in ingress.init_args:
        bound = getattr(arg, "_bound_deployment", None)
        if bound is not None:
            out[bound.name] = bound
    return out


def _effective_shutdown_s(dep: Any, ingress: bool) -> float:
    """The controller's force-kill deadline after it stops a replica, as Ray 2.60 computes it in
    direct ingress: deploy_utils.py 86-98 floors an ingress deployment's timeout at the draining
    period + 5 s; deployment_state.py 2167-2186 waits max(timeout, draining period)."""
    t = float(dep._deployment_config.graceful_shutdown_timeout_s)
    if ingress:
        t = max(t, RUN_MIN_DRAINING_PERIOD_S + RAY_DIRECT_INGRESS_SHUTDOWN_BUFFER_S, RUN_MIN_DRAINING_PERIOD_S)
    return t


@pytest.mark.parametrize("relay,name", [("ingress", "Ingress"), ("assembler", "Assembler")])
def test_a_stopping_relay_replica_is_given_time_for_its_longest_request(relay: str, name: str) -> None:
    """A replica Serve stops (autoscaling down, a config redeploy, a replacement) drains: in direct
    ingress it stays reachable for the draining period, closes its listener, then waits for its
    requests in flight (replica.py ``_drain_behind_haproxy`` 2121-2156, ``_drain_ongoing_requests``
    2067-2108) — but the controller force-kills it ``graceful_shutdown_timeout_s`` after the stop
    (deployment_state.py ``stop`` 2167-2186 and ``check_stopped`` 2188-2200: ``ray.kill``). Narwhal
    sets no ``graceful_shutdown_timeout_s`` for Ingress or Assembler (deployments/app.py 38-56), so
    Serve's 20 s applies (constants.py 270): a stream longer than ~15 s after the listener closes
    (request_timeout_s allows 600 s) is cut mid-answer, no error event, no ``[DONE]``; its tickets
    stay charged until the scheduler reaps the dead lease. docs/operations.md ("Autoscaling") says
    "Requests that an Ingress or Assembler replica holds when Serve stops it are drained", and
    scripts/serve_run.py that "in-flight requests are still drained". Expected: a timeout covering
    the draining period plus ``serving.request_timeout_s``."""
    deps = _deployments({"deployment": {"relay": relay}})
    dep = deps[name]
    need = ServingConfig().request_timeout_s + (RUN_MIN_DRAINING_PERIOD_S if name == "Ingress" else 0.0)
    got = _effective_shutdown_s(dep, ingress=name == "Ingress")
    assert got >= need, (
        f"{name}: Serve force-kills a stopping replica after {got:.0f} s; its requests may need {need:.0f} s")


# ---------------------------------------------------------------------------------------------------
# 3. Serve's own limits in front of Narwhal's admission are reached first, and answer nothing


def test_one_ingress_replica_lets_in_everything_narwhal_itself_can_hold() -> None:
    """In direct ingress a request past ``max_ongoing_requests`` is not refused: ``_can_accept_request``
    checks only ``max_queued_requests`` (replica.py 1428-1441; -1, unbounded, by default), and
    ``call_asgi`` then waits on the replica's semaphore (replica.py 3294-3297, ``_start_request``
    2016-2037, semaphore sized ``max_ongoing_requests`` 1125) with no deadline (no Serve request
    timeout is set, and HAProxy puts no ``maxconn`` on a server, haproxy_templates.py 286). Narwhal
    itself holds up to ``phase_concurrency.decode`` admitted plus ``queue_limit`` queued requests
    (2048 by default) and answers past that with its contract's 429/504; but with one Ingress
    replica (``ingress_min_replicas`` 1, ``upscale_delay_s`` 30) only ``max_ongoing_requests``
    (1000) ever reach it: request 1001 waits in Serve, unseen, uncounted, with no ``Retry-After``,
    its TTFT budget running — and so do ``/ready`` (the documented load-balancer check) and
    ``/metrics``. Expected: ``max_ongoing_requests`` above what Narwhal can hold (or derived from it)."""
    cfg = NarwhalConfig()
    adm = cfg.admission
    narwhal_holds = min(cfg.serving.http_retention_limit, adm.phase_concurrency.decode + adm.queue_limit)
    per_replica, _ = cfg.deployment.relay_replica_options(cfg.serving.http_retention_limit,
                                                          cfg.serving.request_timeout_s, 5.0)
    assert per_replica > narwhal_holds, (
        f"one Ingress replica takes {per_replica} requests at once; Narwhal's own admission holds up to "
        f"{narwhal_holds} before it answers 429/504: the rest wait silently in Serve's replica queue")


def test_haproxy_accepts_as_many_connections_as_the_retention_limit(tmp_path: Path) -> None:
    """HAProxy's global ``maxconn`` is Ray's 4096 (haproxy_templates.py 67,
    ``RAY_SERVE_HAPROXY_MAXCONN`` constants.py 771); past it HAProxy stops accepting and new
    clients wait in the kernel's backlog. ``serving.http_retention_limit`` (4096, "requests held at
    once, global": 429 ``retention_full`` with ``Retry-After: 1``) can then never answer: idle
    keep-alive connections count against HAProxy's limit too, so HAProxy's silent limit is reached
    first. Expected: the run environment sets ``RAY_SERVE_HAPROXY_MAXCONN`` above the retention limit
    (with room for idle keep-alives), as it sets HAProxy's client timeout from the config."""
    serving = ServingConfig()
    env = direct_ingress_env(_run_env(), IngressLimits.of([serving]), str(tmp_path))
    maxconn = int(env.get("RAY_SERVE_HAPROXY_MAXCONN", RAY_HAPROXY_MAXCONN))
    assert maxconn > serving.http_retention_limit, (
        f"HAProxy accepts {maxconn} connections at once; Narwhal's retention limit is "
        f"{serving.http_retention_limit}: its 429 is never reached")


# ---------------------------------------------------------------------------------------------------
# 4. Warnings held in Serve's 1000-record log buffer (RAY_SERVE_THROUGHPUT_OPTIMIZED=1)


@pytest.fixture
def serve_logger(tmp_path: Path) -> Iterator[Path]:
    """``ray.serve`` configured as a replica of the run mode configures it, into ``tmp_path``."""
    from ray.serve._private.logging_utils import configure_component_logger
    from ray.serve.schema import LoggingConfig

    ours, serve = logging.getLogger("narwhal"), logging.getLogger("ray.serve")
    saved = (list(ours.handlers), ours.propagate, ours.level, list(serve.handlers), serve.propagate, serve.level)
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    # constants.py 1108-1115: RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (RUN_ENV) makes the replica's log
    # buffer 1000 records (replica.py 1386) and turns the stderr handler off
    optimized = RUN_ENV.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"
    buffer = int(RUN_ENV.get("RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE", "1000" if optimized else "1"))
    configure_component_logger(component_name="Engine-e0", component_id="r1", component_type=None,
                               logging_config=LoggingConfig(logs_dir=str(tmp_path), enable_access_log=False),
                               max_bytes=10**6, backup_count=1, buffer_size=buffer)
    if optimized and RUN_ENV.get("RAY_SERVE_LOG_TO_STDERR", "0") != "1":
        serve.handlers[:] = [h for h in serve.handlers if isinstance(h, logging.handlers.MemoryHandler)]
    try:
        yield tmp_path
    finally:
        for h in serve.handlers:
            h.close()
        ours.handlers[:] = saved[0]
        ours.propagate = saved[1]
        ours.setLevel(saved[2])
        serve.handlers[:] = saved[3]
        serve.propagate = saved[4]
        serve.setLevel(saved[5])


def test_a_narwhal_warning_reaches_the_replica_log(serve_logger: Path) -> None:
    """``to_serve_log`` (deployments/logs.py) hands Narwhal's loggers the handlers of ``ray.serve`` "so
    a warning or an error reaches the replica's log as one". In the run mode
    (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``) that handler is a ``MemoryHandler`` of 1000 records that
    writes only when full or on an ERROR (logging_utils.py 414-420), and nothing flushes it when a
    replica stops (replica.py has no flush; the controller's ``ray.kill`` ends the process). A
    replica whose access log is off (Scheduler, ManagedEngine, KV shards: deployments/app.py) logs
    a handful of lines a day: its warnings — an engine process that died ("Serve will replace this
    replica", deployments/engine.py 140), a failed report to the scheduler, a KV-event gap — sit in
    memory and are lost with the replica. Expected: the warning in the replica's log file."""
    from deployments.logs import to_serve_log

    to_serve_log()
    logging.getLogger("narwhal.managed").warning("managed engine e0: exited with 137; Serve will replace this replica")
    from deployments.engine import log as managed_log

    managed_log.warning("managed engine e0: report to the scheduler failed")
    managed_log.info("managed engine e0 ready at http://127.0.0.1:1")
    written = "".join(p.read_text() for p in serve_logger.glob("*.log"))
    assert "exited with 137" in written and "report to the scheduler failed" in written and "ready at" in written, (
        "the warnings are still in Serve's log buffer, not in the replica's log file")


# ---------------------------------------------------------------------------------------------------
# 5. The ingress app's ASGI lifespan shutdown (what Serve runs as the replica's destructor) leaves
#    the reporter and its parked watch call running


class _ParkedBackend:
    """A scheduler that never answers a watch (as a parked one, up to 5 s) and grants nothing."""

    def __init__(self) -> None:
        self.watching = asyncio.Event()
        self.watch_cancelled = False

    async def report(self, rep: Any) -> None:
        return None

    async def watch(self, lease_id: str) -> bool:
        self.watching.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.watch_cancelled = True
            raise
        return False

    @property
    def local_relay(self) -> None:
        return None


async def test_lifespan_shutdown_ends_the_parked_watch() -> None:
    """docs/architecture.md ("Placement news"): a parked watch call ends "at once when its ingress
    stops (the ingress cancels it: Serve waits for a replica's calls in flight before it stops
    it)", and ``HandleBackend.watch`` (deployments/ingress.py 44-52) cancels the call when its task is
    cancelled. But nothing cancels that task in a Serve replica: the only hook Serve gives an ASGI
    ingress at shutdown is the app's lifespan shutdown (http_util.py ``ASGIAppReplicaWrapper.__del__``
    678-687, run from replica.py ``shutdown`` 2158-2162), and the gateway's lifespan
    (gateway/app.py ``lifespan``) starts the reporter and does nothing after ``yield`` — no
    ``Reporter.stop()``, no last flush. Expected: after the lifespan's shutdown the watch is
    cancelled."""
    from narwhal_serve.gateway.app import build_api
    from narwhal_serve.tokenization.sizer import PromptSizer

    backend = _ParkedBackend()
    app = build_api(NarwhalConfig(), backend, sizer=PromptSizer(None))  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(backend.watching.wait(), 5)
    reporter = app.state.reporter
    try:
        for _ in range(20):
            await asyncio.sleep(0)
        assert backend.watch_cancelled, "the lifespan's shutdown left the watch parked at the scheduler"
    finally:
        await reporter.stop()
