"""The protocol: client requests validated and sized, and the plain types the layers above share.

* :mod:`.estimate` — The one characters-per-token estimate, for prompts the router cannot tokenize
  exactly.
* :mod:`.outcomes` — Terminal classes of an offered request (docs/contract.md, "Admission"); the
  values are the metric names' stems.
* :mod:`.placement` — What the scheduler hands the assembler: a placed request and its ordered
  candidate routes.
* :mod:`.promtext` — Prometheus text exposition: a label value as the format writes it (backslash,
  double quote and newline escaped, as prometheus_client writes them), for every page Narwhal
  renders.
* :mod:`.requests` — Validation and sizing of client requests (the contract's validation rows,
  docs/contract.md, "Errors").
* :mod:`.stats` — What the router did for one finished request, as the relay measured it: read by
  the scheduler's models, the tenants' tallies, the request log and the ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "CHARS_PER_TOKEN": "estimate",
    "DONE_EVENT": "sse",
    "KNOWN_REASONS": "outcomes",
    "Outcome": "outcomes",
    "ParsedRequest": "requests",
    "PlacedRequest": "placement",
    "RelayStats": "stats",
    "Route": "requests",
    "RouteChoice": "placement",
    "TERMINAL": "outcomes",
    "TEXT_PART_TYPES": "requests",
    "check_messages": "requests",
    "check_rendering": "options",
    "lax_bools": "options",
    "check_model": "requests",
    "decode_json": "strictjson",
    "error_events": "sse",
    "escape_label": "promtext",
    "estimate_tokens": "estimate",
    "has_media": "requests",
    "hides_reasoning": "requests",
    "forces_tool": "requests",
    "model_not_found": "requests",
    "parse_request": "requests",
    "part_text_key": "requests",
    "sse_event": "sse",
    "truncated_to": "requests",
    "whole_ids": "requests",
}
__all__ = [
    "CHARS_PER_TOKEN", "DONE_EVENT", "KNOWN_REASONS", "Outcome", "ParsedRequest", "PlacedRequest",
    "RelayStats", "Route", "RouteChoice", "TERMINAL", "TEXT_PART_TYPES", "check_messages", "check_model", "check_rendering", "decode_json", "lax_bools", "error_events",
    "escape_label", "estimate_tokens", "forces_tool", "has_media", "hides_reasoning", "model_not_found", "parse_request", "part_text_key", "sse_event", "truncated_to",
    "whole_ids",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.protocol.estimate import CHARS_PER_TOKEN as CHARS_PER_TOKEN
    from narwhal_serve.protocol.sse import DONE_EVENT as DONE_EVENT
    from narwhal_serve.protocol.outcomes import KNOWN_REASONS as KNOWN_REASONS
    from narwhal_serve.protocol.outcomes import Outcome as Outcome
    from narwhal_serve.protocol.requests import ParsedRequest as ParsedRequest
    from narwhal_serve.protocol.placement import PlacedRequest as PlacedRequest
    from narwhal_serve.protocol.stats import RelayStats as RelayStats
    from narwhal_serve.protocol.requests import Route as Route
    from narwhal_serve.protocol.placement import RouteChoice as RouteChoice
    from narwhal_serve.protocol.outcomes import TERMINAL as TERMINAL
    from narwhal_serve.protocol.requests import TEXT_PART_TYPES as TEXT_PART_TYPES
    from narwhal_serve.protocol.requests import check_messages as check_messages
    from narwhal_serve.protocol.options import check_rendering as check_rendering
    from narwhal_serve.protocol.options import lax_bools as lax_bools
    from narwhal_serve.protocol.requests import check_model as check_model
    from narwhal_serve.protocol.strictjson import decode_json as decode_json
    from narwhal_serve.protocol.sse import error_events as error_events
    from narwhal_serve.protocol.promtext import escape_label as escape_label
    from narwhal_serve.protocol.estimate import estimate_tokens as estimate_tokens
    from narwhal_serve.protocol.requests import has_media as has_media
    from narwhal_serve.protocol.requests import forces_tool as forces_tool
    from narwhal_serve.protocol.requests import hides_reasoning as hides_reasoning
    from narwhal_serve.protocol.requests import model_not_found as model_not_found
    from narwhal_serve.protocol.requests import parse_request as parse_request
    from narwhal_serve.protocol.requests import part_text_key as part_text_key
    from narwhal_serve.protocol.sse import sse_event as sse_event
    from narwhal_serve.protocol.requests import truncated_to as truncated_to
    from narwhal_serve.protocol.requests import whole_ids as whole_ids
