"""Placement: which engines may take a request, how loaded each is, and the ordered candidate routes.

* :mod:`.drift` — Drift: an engine measured slower than its own models, scored, penalized, taken out
  and re-measured.
* :mod:`.engines` — What the scheduler knows about each engine, and which engines may take a
  request.
* :mod:`.health` — Passive health of one engine: a circuit breaker fed by the outcome of real
  attempts, and a backpressure window fed by the engine's own 429/503 ...
* :mod:`.picker` — Placement: eligibility filter → load score in [0, 1] → ordered candidate routes.
* :mod:`.prefix` — Prefix-aware placement: which engine already holds a request's prompt prefix (its
  KV blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "Breaker": "health",
    "CREDIT_EWMA": "prefix",
    "CREDIT_PRIOR": "prefix",
    "EngineState": "engines",
    "FleetPrior": "engines",
    "MAX_CANDIDATES": "picker",
    "PROFILE_OUTPUT_TOKENS": "drift",
    "PROFILE_PROMPT_CHARS": "drift",
    "PrefixIndex": "prefix",
    "PriorCoeffs": "engines",
    "ProfileErrors": "drift",
    "RouteOrder": "order",
    "SetUnion": "prefix",
    "adopt_fleet_prior": "engines",
    "borrows_ttft": "engines",
    "fleet_ttft": "engines",
    "index_capacity": "prefix",
    "matched_blocks": "prefix",
    "may_open": "health",
    "next_id_block_hash": "prefix",
    "id_bytes": "prefix",
    "rel_error": "drift",
    "request_prefix": "prefix",
    "resume_targets": "picker",
    "settled_prior": "engines",
    "was_hit": "prefix",
}
__all__ = [
    "Breaker", "CREDIT_EWMA", "CREDIT_PRIOR", "EngineState", "FleetPrior", "MAX_CANDIDATES", "PROFILE_OUTPUT_TOKENS",
    "PROFILE_PROMPT_CHARS", "PrefixIndex", "PriorCoeffs", "ProfileErrors", "RouteOrder", "SetUnion",
    "adopt_fleet_prior", "borrows_ttft", "fleet_ttft", "index_capacity", "matched_blocks", "may_open",
    "next_id_block_hash", "id_bytes", "rel_error", "request_prefix", "resume_targets", "settled_prior", "was_hit",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.placement.health import Breaker as Breaker
    from narwhal_serve.placement.prefix import CREDIT_EWMA as CREDIT_EWMA
    from narwhal_serve.placement.prefix import CREDIT_PRIOR as CREDIT_PRIOR
    from narwhal_serve.placement.engines import EngineState as EngineState
    from narwhal_serve.placement.engines import FleetPrior as FleetPrior
    from narwhal_serve.placement.picker import MAX_CANDIDATES as MAX_CANDIDATES
    from narwhal_serve.placement.drift import PROFILE_OUTPUT_TOKENS as PROFILE_OUTPUT_TOKENS
    from narwhal_serve.placement.drift import PROFILE_PROMPT_CHARS as PROFILE_PROMPT_CHARS
    from narwhal_serve.placement.prefix import PrefixIndex as PrefixIndex
    from narwhal_serve.placement.engines import PriorCoeffs as PriorCoeffs
    from narwhal_serve.placement.drift import ProfileErrors as ProfileErrors
    from narwhal_serve.placement.order import RouteOrder as RouteOrder
    from narwhal_serve.placement.prefix import SetUnion as SetUnion
    from narwhal_serve.placement.engines import adopt_fleet_prior as adopt_fleet_prior
    from narwhal_serve.placement.engines import borrows_ttft as borrows_ttft
    from narwhal_serve.placement.engines import fleet_ttft as fleet_ttft
    from narwhal_serve.placement.prefix import index_capacity as index_capacity
    from narwhal_serve.placement.prefix import matched_blocks as matched_blocks
    from narwhal_serve.placement.health import may_open as may_open
    from narwhal_serve.placement.prefix import next_id_block_hash as next_id_block_hash
    from narwhal_serve.placement.prefix import id_bytes as id_bytes
    from narwhal_serve.placement.drift import rel_error as rel_error
    from narwhal_serve.placement.prefix import request_prefix as request_prefix
    from narwhal_serve.placement.picker import resume_targets as resume_targets
    from narwhal_serve.placement.engines import settled_prior as settled_prior
    from narwhal_serve.placement.prefix import was_hit as was_hit
