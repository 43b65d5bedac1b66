"""Capacity planning by replay: a request trace through the router's real admission on a virtual
clock, against simulated engines (docs/performance.md, "Capacity planning by replay";
``narwhal-bench replay`` is its command, in ``bench/replay.py``).

* :mod:`.vloop` — an asyncio event loop whose clock jumps to the next timer when nothing is ready.
* :mod:`.engine` — the simulator's engine taken in events (tokens counted between changes, not stepped).
* :mod:`.trace` — the traces it reads (Azure 2023, Mooncake FAST'25, Narwhal's own JSONL) and the
  token IDs and block hashes their prompts stand for.
* :mod:`.run` — one replay: the scheduler service, the ingress leases and the gateway's admission,
  unchanged, driving the engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "Costs": "costs",
    "FleetSpec": "run",
    "REPLAY_ENGINE": "run",
    "Replay": "run",
    "ReplayOptions": "run",
    "Served": "run",
    "TRACE_BLOCK_TOKENS": "trace",
    "TraceRecord": "trace",
    "TraceRequest": "trace",
    "load": "trace",
    "load_trace": "trace",
    "run_virtual": "vloop",
}
__all__ = [
    "Costs", "FleetSpec", "REPLAY_ENGINE", "Replay", "ReplayOptions", "Served", "TRACE_BLOCK_TOKENS",
    "TraceRecord", "TraceRequest", "load", "load_trace", "run_virtual",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.replay.costs import Costs as Costs
    from narwhal_serve.replay.run import FleetSpec as FleetSpec
    from narwhal_serve.replay.run import REPLAY_ENGINE as REPLAY_ENGINE
    from narwhal_serve.replay.run import Replay as Replay
    from narwhal_serve.replay.run import ReplayOptions as ReplayOptions
    from narwhal_serve.replay.run import Served as Served
    from narwhal_serve.replay.trace import TRACE_BLOCK_TOKENS as TRACE_BLOCK_TOKENS
    from narwhal_serve.replay.trace import TraceRecord as TraceRecord
    from narwhal_serve.replay.trace import TraceRequest as TraceRequest
    from narwhal_serve.replay.trace import load as load
    from narwhal_serve.replay.trace import load_trace as load_trace
    from narwhal_serve.replay.vloop import run_virtual as run_virtual
