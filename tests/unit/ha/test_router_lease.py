"""The router lease's modes from backend answers, on a virtual monotonic clock (pure)."""

from __future__ import annotations

from narwhal_serve.ha.lease import RouterLease, safety_margin


def test_active_while_renewed_then_fenced_then_standby_when_another_holds_it() -> None:
    lease = RouterLease("me", ttl_s=10.0)
    assert lease.mode(0.0) == "standby" and lease.remaining(0.0) == 0.0
    lease.on_answer(True, 7, "me", sent_at=100.0)
    stop = 100.0 + 10.0 - safety_margin(10.0)
    assert lease.mode(stop - 0.01) == "active" and lease.epoch == 7
    lease.on_error("ConnectionError")  # renewals fail: nothing changes until the lease lapses
    assert lease.mode(stop - 0.01) == "active"
    assert lease.mode(stop) == "fenced" and lease.epoch == 0 and lease.fenced_epoch == 7
    assert lease.view(stop)["last_error"] == "ConnectionError"
    lease.on_answer(False, 8, "other", sent_at=stop + 1)
    assert lease.mode(stop + 1) == "standby" and lease.holder == "other" and lease.seen_epoch == 8


def test_the_lease_is_counted_from_when_the_renewal_was_sent() -> None:
    lease = RouterLease("me", ttl_s=4.0)
    lease.on_answer(True, 1, "me", sent_at=50.0)  # an answer that arrives late is no longer lease
    assert lease.valid_until == 50.0 + 4.0 - safety_margin(4.0)
    lease.on_answer(True, 1, "me", sent_at=52.0)
    assert lease.valid_until == 52.0 + 4.0 - safety_margin(4.0) and lease.acquisitions == 1


def test_a_new_epoch_is_a_new_acquisition() -> None:
    lease = RouterLease("me", ttl_s=4.0)
    lease.on_answer(True, 1, "me", sent_at=0.0)
    assert lease.mode(10.0) == "fenced"
    lease.on_answer(True, 2, "me", sent_at=10.0)  # the key lapsed and this router took it again
    assert lease.mode(10.0) == "active" and lease.epoch == 2 and lease.fenced_epoch == 0 and lease.acquisitions == 2
