"""``narwhal-bench``: load generator, baselines (direct, bare proxy, round-robin), Narwhal open and
predictive, goodput report and plots.  ``narwhal-bench overhead --help`` / ``goodput --help``.

Modules: ``workload`` (arrivals, lengths, bodies), ``client`` (aiohttp load generator), ``stats``
(percentiles, goodput, Retry-After accuracy: definitions in its docstring), ``proxy`` (the bare
baseline), ``procs``/``fleet`` (child processes and targets), ``overhead``/``goodput`` (the modes),
``report``/``views`` (tables, JSON, plots), ``cli``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "main": "cli",
}
__all__ = [
    "main",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.bench.cli import main as main
