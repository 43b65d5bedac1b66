"""The one ticket ledger (admission/ledger.py): what each event charges, that a ticket's whole life
leaves nothing behind, and that the scheduler's live counts and a lease's summed deltas agree."""

from __future__ import annotations

import random

from narwhal_serve.admission import ledger
from narwhal_serve.admission.core import EngineDelta, Placement
from narwhal_serve.admission.ledger import Deltas, Ticket, add
from narwhal_serve.config import EngineConfig
from narwhal_serve.protocol.placement import RouteChoice

E = {n: EngineConfig(name=n, url=f"http://127.0.0.1:1/{n}") for n in ("a", "b", "p", "d")}


def placement(route: RouteChoice, prompt: int = 100, cached: int = 20, out: float = 50.0,
              prefix: tuple[int, ...] = (11, 12)) -> Placement:
    first = route.prefill.name if route.prefill else route.decode.name
    return Placement((route,), first, prompt, prompt, 0.0, 0.1, expected_out=out, decode_engine=route.decode.name,
                     cached_tokens=cached, max_output_tokens=200, prefix=prefix)


SINGLE = RouteChoice("single", E["a"])
PD = RouteChoice("pd", E["d"], E["p"])


def total(*ds: Deltas) -> Deltas:
    out: Deltas = {}
    for d in ds:
        add(out, d)
    return out


def test_admission_charges_in_flight_pending_prefill_prefix_and_decode() -> None:
    t = Ticket(placement(PD))
    got = ledger.admitted(t)
    assert got["p"] == EngineDelta(inflight=1, pending_prefill_tokens=80, pending_prefill_requests=1,
                                   prefix=frozenset({11, 12}))
    assert got["d"] == EngineDelta(inflight=1, decode_tokens=50.0)
    assert (t.engines, t.decode_engine, t.decode_charged, t.prefill_done) == (("p", "d"), "d", 50.0, False)


def test_first_token_ends_the_prefill_once_and_a_resume_moves_the_charges() -> None:
    t = Ticket(placement(SINGLE))
    ledger.admitted(t)
    first = ledger.first_token(t, ("a",))
    assert first == {"a": EngineDelta(pending_prefill_tokens=-80, pending_prefill_requests=-1,
                                      prefix_done=frozenset({11, 12}), prefills_done=1)}
    ledger.progressed(t, 30)  # 50 expected, 30 generated: 20 left
    assert t.decode_charged == 20.0
    moved = ledger.first_token(t, ("b",))  # the answer resumed on b: its first token there
    assert moved == {"a": EngineDelta(inflight=-1, decode_tokens=-20.0), "b": EngineDelta(inflight=1, decode_tokens=20.0)}
    assert ledger.first_token(t, ("b",)) == {}  # nothing twice


def test_a_tickets_whole_life_leaves_every_count_at_zero() -> None:
    rng = random.Random(7)
    for _ in range(200):
        t = Ticket(placement(rng.choice([SINGLE, PD]), prompt=rng.randrange(1, 500), cached=0,
                             out=rng.uniform(0, 300)))
        events = [ledger.admitted(t)]
        for _ in range(rng.randrange(0, 6)):
            kind = rng.randrange(3)
            if kind == 0:
                events.append(ledger.first_token(t, rng.choice([("a",), ("b",), ("p", "d")])))
            elif kind == 1:
                events.append(ledger.progressed(t, rng.randrange(0, 400)))
            else:
                events.append(ledger.moved(t, rng.choice([("a",), ("b",)])))
        events.append(ledger.released(t))
        left = total(*events)
        for d in left.values():
            assert (d.inflight, d.pending_prefill_tokens, d.pending_prefill_requests) == (0, 0, 0), left
            assert abs(d.decode_tokens) < 1e-9, left


def test_the_scheduler_applying_each_event_and_a_lease_summing_them_agree() -> None:
    """The scheduler applies every event to live counts (clamped at zero); a lease sums them into
    its view's adjustment. Same events, same counts."""
    rng = random.Random(3)
    live = {n: [0, 0, 0, 0.0] for n in E}
    summed: Deltas = {}
    tickets = []
    for step in range(300):
        if not tickets or rng.random() < 0.4:
            t = Ticket(placement(rng.choice([SINGLE, PD]), prompt=rng.randrange(1, 300), cached=0,
                                 out=rng.uniform(0, 100)))
            tickets.append(t)
            d = ledger.admitted(t)
        else:
            t = rng.choice(tickets)
            kind = rng.randrange(4)
            if kind == 0:
                d = ledger.first_token(t, t.engines)
            elif kind == 1:
                d = ledger.progressed(t, rng.randrange(0, 150))
            elif kind == 2:
                d = ledger.moved(t, rng.choice([("a",), ("b",), ("p", "d")]))
            else:
                d = ledger.released(t)
                tickets.remove(t)
        for name, x in d.items():
            c = live[name]
            c[0] += x.inflight
            c[1] = max(0, c[1] + x.pending_prefill_tokens)
            c[2] = max(0, c[2] + x.pending_prefill_requests)
            c[3] = max(0.0, c[3] + x.decode_tokens)
        add(summed, d)
        for name, c in live.items():
            s = summed.get(name, EngineDelta())
            assert c[0] == s.inflight >= 0 and c[1] == s.pending_prefill_tokens and c[2] == s.pending_prefill_requests
            assert abs(c[3] - s.decode_tokens) < 1e-6
