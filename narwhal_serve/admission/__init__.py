"""Admission: the contract's admission table, the one decision both the scheduler and the ingress
leases run, and the one ticket ledger after it (pure: no Ray, no I/O).

* :mod:`.controller` — The contract's admission table as one pure state machine.
* :mod:`.core` — The admission decision, one pure function that both holders run: the scheduler (for
  its queue) and every ingress replica (under its ...
* :mod:`.counters` — Global accounting: offered, unsized_offered and one terminal class per offered
  request.
* :mod:`.lease` — An ingress replica's admission lease: admit, refuse and place locally, with no
  scheduler call.
* :mod:`.ledger` — The bookkeeping after an admission decision: one copy, for the scheduler and the
  ingress lease.
* :mod:`.predictive` — The contract's two predictive rows: prompt alone over budget, projected TTFT
  over budget.
* :mod:`.retry` — Retry-After a client can trust: room kept for the clients told to come back.
* :mod:`.view` — What an admission decision is made on and what it returns: one engine's facts, a
  holder's own changes, the fleet view, the request's ask and the placement.
* :mod:`.wire` — What a lease and the scheduler tell each other across the Ray hop: the ingress's
  part of a report (its placements, permits in use and given back) and ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "AdmissionController": "controller",
    "AdmissionLease": "lease",
    "Ask": "core",
    "ChangedRow": "facts",
    "CounterDelta": "counters",
    "Counters": "counters",
    "EngineFacts": "core",
    "Enqueued": "controller",
    "FACT_FIELDS": "facts",
    "FactsRow": "facts",
    "FleetView": "view",
    "Grant": "controller",
    "LeaseGrant": "wire",
    "LeasePart": "wire",
    "LocalPlacement": "wire",
    "MAX_RESERVATIONS": "retry",
    "NONE": "controller",
    "Permits": "controller",
    "Placement": "core",
    "PrefixChange": "facts",
    "Refusal": "controller",
    "Reservation": "retry",
    "Ticket": "ledger",
    "decide": "core",
    "earliest": "retry",
    "facts_from": "facts",
    "prefix_change": "facts",
    "rank": "core",
    "releases": "ledger",
    "retry_count": "retry",
    "unbalanced": "counters",
}
__all__ = [
    "AdmissionController", "AdmissionLease", "Ask", "ChangedRow", "CounterDelta", "Counters", "EngineFacts",
    "Enqueued", "FACT_FIELDS", "FactsRow", "FleetView", "Grant", "LeaseGrant", "LeasePart", "LocalPlacement",
    "MAX_RESERVATIONS", "NONE", "Permits", "Placement", "PrefixChange", "Refusal", "Reservation", "Ticket",
    "decide", "earliest", "facts_from", "prefix_change", "rank", "releases", "retry_count", "unbalanced",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.admission.controller import AdmissionController as AdmissionController
    from narwhal_serve.admission.lease import AdmissionLease as AdmissionLease
    from narwhal_serve.admission.core import Ask as Ask
    from narwhal_serve.admission.facts import ChangedRow as ChangedRow
    from narwhal_serve.admission.counters import CounterDelta as CounterDelta
    from narwhal_serve.admission.counters import Counters as Counters
    from narwhal_serve.admission.core import EngineFacts as EngineFacts
    from narwhal_serve.admission.controller import Enqueued as Enqueued
    from narwhal_serve.admission.facts import FACT_FIELDS as FACT_FIELDS
    from narwhal_serve.admission.facts import FactsRow as FactsRow
    from narwhal_serve.admission.view import FleetView as FleetView
    from narwhal_serve.admission.controller import Grant as Grant
    from narwhal_serve.admission.wire import LeaseGrant as LeaseGrant
    from narwhal_serve.admission.wire import LeasePart as LeasePart
    from narwhal_serve.admission.wire import LocalPlacement as LocalPlacement
    from narwhal_serve.admission.retry import MAX_RESERVATIONS as MAX_RESERVATIONS
    from narwhal_serve.admission.controller import NONE as NONE
    from narwhal_serve.admission.controller import Permits as Permits
    from narwhal_serve.admission.core import Placement as Placement
    from narwhal_serve.admission.facts import PrefixChange as PrefixChange
    from narwhal_serve.admission.controller import Refusal as Refusal
    from narwhal_serve.admission.retry import Reservation as Reservation
    from narwhal_serve.admission.ledger import Ticket as Ticket
    from narwhal_serve.admission.ledger import releases as releases
    from narwhal_serve.admission.core import decide as decide
    from narwhal_serve.admission.retry import earliest as earliest
    from narwhal_serve.admission.facts import facts_from as facts_from
    from narwhal_serve.admission.facts import prefix_change as prefix_change
    from narwhal_serve.admission.core import rank as rank
    from narwhal_serve.admission.retry import retry_count as retry_count
    from narwhal_serve.admission.counters import unbalanced as unbalanced
