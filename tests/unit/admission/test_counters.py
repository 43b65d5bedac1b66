"""The one "counters balance" check: offered against the terminal classes of the contract view."""

from __future__ import annotations

from narwhal_serve.admission.counters import CounterDelta, Counters, unbalanced
from narwhal_serve.protocol.outcomes import TERMINAL, Outcome


def test_a_request_offered_and_not_yet_ended_leaves_the_books_unbalanced_by_one() -> None:
    c = Counters()
    c.merge(CounterDelta(offered=3, unsized_offered=1))
    assert unbalanced(c.contract_view()) == 3
    done = CounterDelta()
    for o, reason in ((Outcome.COMPLETED, ""), (Outcome.INVALID, "request_timeout")):
        done.outcomes[(o.value, reason)] += 1
    c.merge(done)
    assert unbalanced(c.contract_view()) == 1
    last = CounterDelta()
    last.outcomes[(Outcome.CANCELLED.value, "client_disconnected")] += 1
    c.merge(last)
    assert unbalanced(c.contract_view()) == 0


def test_every_terminal_class_counts_and_missing_keys_are_zero() -> None:
    view = {"offered": len(TERMINAL), **{o.value: 1 for o in TERMINAL}}
    assert unbalanced(view) == 0
    assert unbalanced({}) == 0
    assert unbalanced({"offered": 2, "completed": 3}) == -1  # an outcome counted twice shows too
