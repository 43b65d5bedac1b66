"""One simulated engine in-process on a free 127.0.0.1 port, for the duration of a block."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.server import SimServer, start_server


@contextlib.asynccontextmanager
async def sim_engine(**timing: float) -> AsyncIterator[SimServer]:
    """``timing``: SimEngineConfig fields (prefill_overhead_s, tpot_base_s, …); no early EOS."""
    srv = await start_server(SimEngineConfig(eos_prob=0, **timing), "127.0.0.1", 0)  # type: ignore[arg-type]
    try:
        yield srv
    finally:
        await srv.stop()
