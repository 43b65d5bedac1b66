"""Embedded vLLM-compatible engine simulator (like llm-d's inference-sim).

Public API: :class:`narwhal_serve.config.sim.SimEngineConfig`, :func:`narwhal_serve.sim.app.create_app`,
:func:`narwhal_serve.sim.server.start_server` / :class:`narwhal_serve.sim.server.SimServer`, and the
``narwhal-sim`` console script (:func:`narwhal_serve.sim.cli.main`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "Engine": "engine",
    "Histogram": "engine",
    "KVEventSink": "kvevents",
    "Scheduler": "engine",
    "SimServer": "server",
    "SimTokenizer": "tokenizer",
    "block_hashes": "timing",
    "prefill_deadline": "timing",
    "render_chat": "textgen",
    "render_metrics": "metrics",
    "start_server": "server",
    "token_interval": "timing",
}
__all__ = [
    "Engine", "Histogram", "KVEventSink", "Scheduler", "SimServer", "SimTokenizer", "block_hashes",
    "prefill_deadline", "render_chat", "render_metrics", "start_server", "token_interval",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.sim.engine import Engine as Engine
    from narwhal_serve.sim.engine import Histogram as Histogram
    from narwhal_serve.sim.kvevents import KVEventSink as KVEventSink
    from narwhal_serve.sim.engine import Scheduler as Scheduler
    from narwhal_serve.sim.server import SimServer as SimServer
    from narwhal_serve.sim.textgen import render_chat as render_chat
    from narwhal_serve.sim.tokenizer import SimTokenizer as SimTokenizer
    from narwhal_serve.sim.timing import block_hashes as block_hashes
    from narwhal_serve.sim.timing import prefill_deadline as prefill_deadline
    from narwhal_serve.sim.metrics import render_metrics as render_metrics
    from narwhal_serve.sim.server import start_server as start_server
    from narwhal_serve.sim.timing import token_interval as token_interval
