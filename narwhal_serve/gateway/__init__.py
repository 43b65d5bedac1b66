"""The HTTP gateway: the FastAPI app of an ingress replica, from request body to released permits.

* :mod:`.app` — The HTTP surface (docs/contract.md, "Routes"): completion routes, models, health,
  readiness, status, metrics, admin.
* :mod:`.backend` — What the HTTP gateway needs from the rest of the router, as one small interface.
* :mod:`.body` — Reading a request body without ever buffering past ``serving.max_request_bytes``, and the router's own headers.
* :mod:`.completion` — One completion request, arrival to last byte: validate, admit, relay,
  account, release.
* :mod:`.reporter` — Batches an ingress replica's reports to the scheduler ("gated": send now if no
  call is in flight, else as soon as it returns), from a task with a ...
* :mod:`.responses` — Rendering refusals: the OpenAI envelope, Retry-After, X-Narwhal-Reason,
  X-Request-Id.
* :mod:`.streaming` — The SSE response of an admitted streaming request: it owns the request's
  release.
* :mod:`.tenancy` — What the gateway reads from a request about its tenant (docs/contract.md,
  "Tenants", "Priority classes"): who sent it (the API key), its class ...
* :mod:`.tokenize` — ``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, from the router's
  own tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "Refused": "admit",
    "Reporter": "reporter",
    "build_api": "app",
    "class_of": "tenancy",
}
__all__ = [
    "Refused", "Reporter", "build_api", "class_of",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.gateway.admit import Refused as Refused
    from narwhal_serve.gateway.reporter import Reporter as Reporter
    from narwhal_serve.gateway.app import build_api as build_api
    from narwhal_serve.gateway.tenancy import class_of as class_of
