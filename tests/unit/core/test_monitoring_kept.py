"""The scheduler keeps the monitoring's "not degraded" while it is sure to hold (a look at every
engine per decision cost 0.2 ms at 1,000 engines): through time passing, scrapes landing and
failing, monitor passes, maintenance and engines coming and going, its answer equals a fresh look
at every engine, to the instant."""

from __future__ import annotations

import random

import pytest

from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.scheduler.service import SchedulerService
from tests.support.scheduler import Clock


def _fresh(svc: SchedulerService, now: float) -> str | None:
    """The monitoring's part of the verdict, looked at anew (RouterHA.degraded over every engine)."""
    if not svc.router.started:
        return None
    why = svc.ha.degraded(svc.engines.values(), now, frozenset(svc.router.maintenance))
    return "monitoring_degraded" if why else None


def test_the_kept_verdict_equals_a_fresh_look_at_every_instant() -> None:
    rng = random.Random(7)
    clock = Clock()
    cfg = NarwhalConfig.model_validate({
        "monitoring": {"stale_after_s": 3.0, "scrape_interval_s": 1.0, "min_fresh_fraction": 0.5},
        "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{10000 + i}", "wave": f"w{i % 3}"} for i in range(12)],
    })
    svc = SchedulerService(cfg, clock=clock)
    svc.router.started = True
    svc.ha.last_pass = clock.t
    for e in svc.engines.values():
        e.healthy, e.last_ok = True, clock.t - rng.uniform(0, 2)
    extra = 100
    degraded_seen = kept_seen = 0
    for _ in range(3000):
        r = rng.random()
        names = list(svc.engines)
        if r < 0.3:  # scrapes answer with data
            for name in rng.sample(names, min(len(names), rng.choice([1, 2, 4]))):
                svc.engines[name].last_ok = clock.t
        elif r < 0.35:  # a definite "down"
            svc.engines[rng.choice(names)].last_answer = clock.t
        elif r < 0.42:  # a monitor pass
            svc.ha.last_pass = clock.t
            svc.views_stale()
        elif r < 0.44:  # maintenance on or off
            svc.maintenance([rng.choice(sorted({e.cfg.wave for e in svc.engines.values()}))], rng.random() < 0.5)
        elif r < 0.46 and len(names) > 3:  # an engine leaves ...
            svc.deregister_engine(rng.choice(names))
        elif r < 0.48:  # ... or joins, with no data yet
            svc.register_engine(EngineConfig(name=f"x{extra}", url=f"http://127.0.0.1:{20000 + extra}"))
            extra += 1
        clock.t += rng.choice([0.0, 0.01, 0.1, 0.3, 0.7, 0.7, 1.5])
        fresh = _fresh(svc, clock.t)
        got = svc._fleet_reason(clock.t)
        assert got == fresh, (clock.t, got, fresh)
        degraded_seen += fresh is not None
        kept_seen += svc._fleet_kept is not None
    assert degraded_seen > 50 and kept_seen > 500  # (both states were met, many times)


def test_a_degraded_monitoring_is_logged_once_per_change_not_per_decision(caplog: pytest.LogCaptureFixture) -> None:
    """While the monitor loop stays stalled every decision looks again and the reason's numbers
    change ("stalled for 9.1 s", "9.2 s", ...): one warning when it degrades, one when it recovers
    (it logged a warning per admission before)."""
    clock = Clock()
    cfg = NarwhalConfig.model_validate({
        "monitoring": {"stale_after_s": 3.0, "scrape_interval_s": 1.0, "min_fresh_fraction": 0.5},
        "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{10000 + i}"} for i in range(4)],
    })
    svc = SchedulerService(cfg, clock=clock)
    svc.router.started = True
    svc.ha.last_pass = clock.t
    for e in svc.engines.values():
        e.healthy, e.last_ok = True, clock.t
    caplog.set_level("WARNING", logger="narwhal.ha")
    reasons = set()
    start = clock.t
    for _ in range(50):
        clock.t += 0.5
        assert svc._fleet_reason(clock.t) == (None if clock.t - start <= 3.0 else "monitoring_degraded")
        reasons.add(svc.ha.degraded_why)
    assert len(reasons) > 10  # the reason's text kept changing
    svc.ha.last_pass = clock.t
    for e in svc.engines.values():
        e.last_ok = clock.t
    svc.views_stale()
    assert svc._fleet_reason(clock.t) is None and svc.ha.degraded_why is None
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and msgs[0].startswith("monitoring degraded: monitor loop stalled") \
        and msgs[1] == "monitoring recovered", msgs
