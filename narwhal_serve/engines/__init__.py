"""Engines: how each kind of engine is asked for a completion (one module per dialect), and the HTTP,
SSE and /metrics plumbing to them.

* :mod:`.client` — HTTP calls to engines: one streamed completion, one JSON completion.
* :mod:`.dialect` — The dialect contract: how one kind of engine is asked for a completion.
* :mod:`.errors` — Engine-side failures, as the relay sees them.
* :mod:`.legs` — Opening the client-facing stream of one route: a single leg, or a P/D pair
  (docs/contract.md, "Engine dialects and token identity").
* :mod:`.metrics` — Reading the few vLLM /metrics lines a router needs (Prometheus text format).
* :mod:`.openai` — Plain OpenAI-compatible servers: no token IDs, no P/D.
* :mod:`.sglang` — SGLang dialect: P/D by bootstrap — the same body plus bootstrap fields to both
  legs at once.
* :mod:`.sse` — An incremental Server-Sent Events decoder that survives arbitrary chunk splits.
* :mod:`.vllm` — vLLM dialect (docs/contract.md, "Engine dialects and token identity"): token IDs on
  every chunk, P/D by the two-step kv_transfer_params protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "EngineFailure": "errors",
    "EngineLoad": "metrics",
    "FaultKind": "errors",
    "LegCursor": "legs",
    "PATHS": "dialect",
    "SSEDecoder": "sse",
    "TRANSPORT_ERRORS": "client",
    "client_body": "vllm",
    "dialect_of": "legs",
    "engine_client": "client",
    "open_route": "legs",
    "parse_engine_metrics": "metrics",
    "post_json": "client",
    "prioritized": "legs",
    "stream_chunks": "client",
}
__all__ = [
    "EngineFailure", "EngineLoad", "FaultKind", "LegCursor", "PATHS", "SSEDecoder", "TRANSPORT_ERRORS",
    "client_body", "dialect_of", "engine_client", "open_route", "parse_engine_metrics", "post_json", "prioritized",
    "stream_chunks",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.engines.errors import EngineFailure as EngineFailure
    from narwhal_serve.engines.metrics import EngineLoad as EngineLoad
    from narwhal_serve.engines.errors import FaultKind as FaultKind
    from narwhal_serve.engines.legs import LegCursor as LegCursor
    from narwhal_serve.engines.dialect import PATHS as PATHS
    from narwhal_serve.engines.sse import SSEDecoder as SSEDecoder
    from narwhal_serve.engines.client import TRANSPORT_ERRORS as TRANSPORT_ERRORS
    from narwhal_serve.engines.vllm import client_body as client_body
    from narwhal_serve.engines.legs import dialect_of as dialect_of
    from narwhal_serve.engines.client import engine_client as engine_client
    from narwhal_serve.engines.legs import open_route as open_route
    from narwhal_serve.engines.metrics import parse_engine_metrics as parse_engine_metrics
    from narwhal_serve.engines.client import post_json as post_json
    from narwhal_serve.engines.legs import prioritized as prioritized
    from narwhal_serve.engines.client import stream_chunks as stream_chunks
