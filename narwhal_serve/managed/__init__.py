"""Ray-managed engines: an engine entry with a ``launch`` spec instead of a ``url``.

* :mod:`narwhal_serve.config.launch` — the launch spec (pydantic; a section of the config, and
  validated with it).
* :mod:`.command` — pure builders: the engine's argv and environment, the Serve deployment options.
* :mod:`.process` — one engine process: start, wait for ``/health``, watch, stop (plain asyncio).
* :mod:`.slot` — what a replica reports and what the scheduler keeps per managed engine.

The Ray side is ``deployments/engine.py`` (one replica supervises one engine process); the
scheduler's bookkeeping is :mod:`narwhal_serve.scheduler.managed`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "EngineProcess": "process",
    "HEALTH_HTTP_TIMEOUT_S": "command",
    "HEARTBEAT_S": "slot",
    "ManagedSlot": "slot",
    "ReplicaReport": "slot",
    "deployment_names": "command",
    "deployment_options": "command",
    "engine_argv": "command",
    "engine_env": "command",
    "guard_prefix": "command",
    "kv_event_endpoints": "command",
    "kv_events_wanted": "command",
    "log_tail": "process",
    "slot_names": "slot",
    "url_host": "command",
}
__all__ = [
    "EngineProcess", "HEALTH_HTTP_TIMEOUT_S", "HEARTBEAT_S", "ManagedSlot", "ReplicaReport",
    "deployment_names", "deployment_options", "engine_argv", "engine_env", "guard_prefix",
    "kv_event_endpoints", "kv_events_wanted", "log_tail", "slot_names", "url_host",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.managed.process import EngineProcess as EngineProcess
    from narwhal_serve.managed.command import HEALTH_HTTP_TIMEOUT_S as HEALTH_HTTP_TIMEOUT_S
    from narwhal_serve.managed.slot import HEARTBEAT_S as HEARTBEAT_S
    from narwhal_serve.managed.slot import ManagedSlot as ManagedSlot
    from narwhal_serve.managed.slot import ReplicaReport as ReplicaReport
    from narwhal_serve.managed.command import deployment_names as deployment_names
    from narwhal_serve.managed.command import deployment_options as deployment_options
    from narwhal_serve.managed.command import engine_argv as engine_argv
    from narwhal_serve.managed.command import engine_env as engine_env
    from narwhal_serve.managed.command import guard_prefix as guard_prefix
    from narwhal_serve.managed.command import kv_event_endpoints as kv_event_endpoints
    from narwhal_serve.managed.command import kv_events_wanted as kv_events_wanted
    from narwhal_serve.managed.process import log_tail as log_tail
    from narwhal_serve.managed.slot import slot_names as slot_names
    from narwhal_serve.managed.command import url_host as url_host
