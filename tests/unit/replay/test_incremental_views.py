"""The facts granted to leases are read again only for the engines touched since the last grant
(scheduler/state.py ``_refresh_granted``, scheduler/granted.py; every engine at least each FULL_VIEW_S and after each
scrape pass). Here every incremental refresh of whole replays is checked against every engine read
anew (``check_views``): overload with refusals and retries, shared prefixes followed by KV events in
the scheduler and through shards, a prefill/decode fleet. A state change the scheduler makes
without touching its engine fails the run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.replay.run import FleetSpec, Replay, ReplayOptions
from narwhal_serve.replay.vloop import run_virtual
from narwhal_serve.scheduler.state import SchedulerState
from tests.unit.replay.test_replay import ENGINE, _settled, _trace


@pytest.fixture
def checked() -> Iterator[None]:
    SchedulerState.check_views = True
    yield
    SchedulerState.check_views = False


@pytest.mark.parametrize("shards", [0, 2])
@pytest.mark.parametrize("fleet", [FleetSpec(unified=6, engine=ENGINE), FleetSpec(prefill=2, decode=3, unified=1, engine=ENGINE)],
                         ids=["unified", "pd"])
def test_every_incremental_grant_view_equals_every_engine_read_anew(checked: None, shards: int, fleet: FleetSpec) -> None:
    cfg = NarwhalConfig.model_validate({"placement": {"kv_event_shards": shards}})
    rp = Replay(cfg, fleet, ReplayOptions())
    served = run_virtual(rp.run(_trace(500, 40.0, prompt=1500, out=80, shared=4)))
    assert {s.status for s in served} >= {200, 429}  # overloaded: refusals, retries, queueing
    assert sum(e.cache.hits for e in rp.engines.values()) > 0
    _settled(rp)
