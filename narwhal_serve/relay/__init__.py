"""The relay: attempts at candidate routes, the checked stream to the client, mid-stream resume.

* :mod:`.attempt` — One attempt at one route, and what the relay writes: the per-attempt state (its
  meter of token IDs and timing, the transcript a resume continues ...
* :mod:`.coalesce` — Coalescing an engine stream for the one streaming hop to the ingress.
* :mod:`.messages` — What the assembler sends the ingress over the one streaming hop: one message
  type.
* :mod:`.pipeline` — The assembler's work for one placed request: try candidate routes until one
  answers, then relay its stream (streaming clients) or fold it into one ...
* :mod:`.resume` — Mid-stream resume (docs/contract.md, "Engine failures"): what an answer cut after
  its first token needs to continue on another engine exactly where ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "EngineFault": "messages",
    "EngineWorked": "messages",
    "HealthEvent": "messages",
    "RESUME_OUTCOMES": "messages",
    "RESUME_REASONS": "messages",
    "Relay": "pipeline",
    "RelayMessage": "messages",
    "relay_of": "pipeline",
}
__all__ = [
    "EngineFault", "EngineWorked", "HealthEvent", "RESUME_OUTCOMES", "RESUME_REASONS", "Relay",
    "RelayMessage", "relay_of",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.relay.messages import EngineFault as EngineFault
    from narwhal_serve.relay.messages import EngineWorked as EngineWorked
    from narwhal_serve.relay.messages import HealthEvent as HealthEvent
    from narwhal_serve.relay.messages import RESUME_OUTCOMES as RESUME_OUTCOMES
    from narwhal_serve.relay.messages import RESUME_REASONS as RESUME_REASONS
    from narwhal_serve.relay.pipeline import Relay as Relay
    from narwhal_serve.relay.messages import RelayMessage as RelayMessage
    from narwhal_serve.relay.pipeline import relay_of as relay_of
