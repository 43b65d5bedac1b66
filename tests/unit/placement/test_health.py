"""The circuit breaker and backpressure window of one engine (pure, virtual time)."""

from __future__ import annotations

from narwhal_serve.config import MonitoringConfig
from narwhal_serve.placement.health import BACKPRESSURE_CAP_S, Breaker, may_open

CFG = MonitoringConfig(breaker_failures=2, breaker_open_s=1.0, breaker_max_open_s=3.0, backpressure_s=0.5)


def test_consecutive_failures_open_the_breaker_and_a_success_in_between_resets() -> None:
    b = Breaker()
    b.on_fault("error", 10.0, CFG)
    b.on_success()  # a good first token in between: not consecutive
    b.on_fault("timeout", 10.1, CFG)
    assert b.takes_work(10.1) and b.failures == 1
    b.on_fault("error", 10.2, CFG, why="HTTP 500")
    assert not b.takes_work(10.2) and b.state == "open" and b.open_until == 11.2
    v = b.view(10.2)
    assert v["breaker"] == "open" and v["consecutive_failures"] == 2 and v["last_fault"] == "HTTP 500"
    assert v["faults_total"] == {"error": 2, "timeout": 1}


def test_probe_after_the_open_period_closes_or_reopens_for_longer_up_to_the_cap() -> None:
    b = Breaker()
    for t in (0.0, 0.1):
        b.on_fault("error", t, CFG)
    assert not b.probe_due(1.0) and b.probe_due(1.1) and b.state == "probing"
    assert not b.takes_work(1.2) and not b.probe_due(1.2)  # one probe at a time, still no client work
    b.on_probe(False, 1.3, CFG, "probe answered HTTP 500")
    assert b.state == "open" and b.open_s == 2.0  # doubled
    assert b.probe_due(3.3)
    b.on_probe(False, 3.4, CFG)
    assert b.open_s == 3.0  # capped at breaker_max_open_s
    assert b.probe_due(6.4)
    b.on_probe(True, 6.5, CFG)
    assert b.takes_work(6.5) and b.failures == 0 and b.opened == 0
    assert b.view(6.5)["probes_total"] == {"failed": 2, "ok": 1}
    for t in (7.0, 7.1):  # opens again from the first period
        b.on_fault("error", t, CFG)
    assert b.open_s == 1.0


def test_a_real_success_while_open_closes_it_but_not_while_a_probe_decides() -> None:
    b = Breaker()
    for t in (0.0, 0.1):
        b.on_fault("error", t, CFG)
    b.on_success()  # a request placed before the breaker opened got its first token: the engine works
    assert b.takes_work(0.2)
    for t in (0.3, 0.4):
        b.on_fault("error", t, CFG)
    assert b.probe_due(2.0)
    b.on_success()
    assert b.state == "probing"  # the probe's own answer decides


def test_backpressure_is_not_a_failure_and_holds_for_retry_after_capped() -> None:
    b = Breaker()
    b.on_fault("backpressure", 0.0, CFG)
    assert not b.takes_work(0.4) and b.takes_work(0.5) and b.failures == 0 and b.state == "closed"
    b.on_fault("backpressure", 1.0, CFG, retry_after_s=3.0)
    assert not b.takes_work(3.9) and b.takes_work(4.0)
    b.on_fault("backpressure", 5.0, CFG, retry_after_s=3600.0)
    assert b.backpressure_until == 5.0 + BACKPRESSURE_CAP_S
    assert b.view(6.0)["backpressure_for_s"] == 9.0 and b.view(6.0)["breaker"] == "closed"



def test_how_many_breakers_may_be_open() -> None:
    half = MonitoringConfig()
    assert not may_open(0, 1, half)  # a sole engine's breaker never opens
    assert may_open(0, 2, half) and not may_open(1, 2, half)
    assert may_open(1, 4, half) and not may_open(2, 4, half)
    assert may_open(8, 10, MonitoringConfig(breaker_max_open_fraction=1.0)) and not may_open(9, 10, MonitoringConfig(breaker_max_open_fraction=1.0))


def test_a_breaker_that_may_not_open_opens_at_the_next_failure_once_it_may() -> None:
    b = Breaker()
    for t in (0.0, 0.1):
        b.on_fault("error", t, CFG, may_open=False)
    assert b.state == "closed" and b.failures == 2
    b.on_fault("error", 0.2, CFG)
    assert b.state == "open"
