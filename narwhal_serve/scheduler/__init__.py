"""The scheduler: the single source of truth for engines, router state, admission queue, leases and
counters.

* :mod:`.admin` — The scheduler's admin operations (docs/operations.md): router mode, drain,
  maintenance waves, engines registered at run time and managed engines' ...
* :mod:`.api` — The scheduler's call surface, as both the Ray deployment and the in-process backend
  expose it.
* :mod:`.ha` — What makes the router refuse everything by itself: its lease (standby, fenced) and
  its own monitoring (monitoring_degraded).  The scheduler owns one ...
* :mod:`.health` — The scheduler's side of passive engine health: failed attempts reported by
  ingress replicas feed each engine's breaker ...
* :mod:`.kvfeeds` — The scheduler's KV-event feeds: one subscriber task per engine configured with
  ``kv_events``, each applying its engine's events to that engine's ...
* :mod:`.learning` — What the scheduler learns from a finished request (pure: the state is passed
  in).
* :mod:`.leases` — The scheduler's side of admission leases: who holds what, how much more to grant,
  and what to reclaim from a lease that went silent (its ingress ...
* :mod:`.managed` — The scheduler's bookkeeping of managed engines: which replica's engine holds
  which place in the fleet, at which URL, on which node.
* :mod:`.messages` — Plain-data messages between ingress replicas and the scheduler (they cross the
  Ray hop).
* :mod:`.monitor` — Engine health and /metrics scraping: one pass over every engine, concurrently;
  and the probe that closes an open circuit breaker.
* :mod:`.queueing` — The scheduler's admission: one admit call (a request the ingress lease could
  not place), the queue of requests waiting for permits, and cancellation.
* :mod:`.service` — The scheduler: single source of truth for engines, router state, admission and
  counters.
* :mod:`.snapshot` — ``/status``: the scheduler's whole state as plain JSON (docs/contract.md,
  "Routes").
* :mod:`.state` — The scheduler's state: engines, router state, admission, leases, tenants, counters
  and tickets, and the fleet view every decision is made on ...
* :mod:`.tickets` — The scheduler's tickets: each admitted request's charges on the engines (the
  ledger's, ``admission/ledger.py``, applied to the engines' live counts), ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "AdmitRequest": "messages",
    "AdmitResult": "messages",
    "Report": "messages",
    "SchedulerApi": "api",
    "SchedulerService": "service",
    "exact_index": "kvfeeds",
    "scraped": "monitor",
}
__all__ = [
    "AdmitRequest", "AdmitResult", "Report", "SchedulerApi", "SchedulerService", "exact_index", "scraped",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.scheduler.messages import AdmitRequest as AdmitRequest
    from narwhal_serve.scheduler.messages import AdmitResult as AdmitResult
    from narwhal_serve.scheduler.messages import Report as Report
    from narwhal_serve.scheduler.api import SchedulerApi as SchedulerApi
    from narwhal_serve.scheduler.service import SchedulerService as SchedulerService
    from narwhal_serve.scheduler.kvfeeds import exact_index as exact_index
    from narwhal_serve.scheduler.monitor import scraped as scraped
