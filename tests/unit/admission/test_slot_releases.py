"""The slot wait from each request's own remaining decode: when a slot frees for each place in line
(prediction/ttft.py slot_releases), what the scheduler's tickets make of it (admission/ledger.py
releases) and how a decision reads it."""

from __future__ import annotations

import heapq
import math
import random
import statistics

import pytest

from narwhal_serve.admission.core import Ask, decide
from narwhal_serve.admission.ledger import Ticket, releases
from narwhal_serve.admission.view import Placement
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.prediction.ttft import released_wait_s, slot_releases, slot_wait_s
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from narwhal_serve.scheduler.service import SchedulerService
from tests.support.scheduler import Clock
from tests.unit.admission.test_overload_decisions import NOW, engine, placed, view


def test_each_place_in_line_gets_the_slot_that_frees_first() -> None:
    # four slots held for 5, 1, 3, 2 s; two in line for 10 s each; later ones 1 s each
    assert slot_releases([5, 1, 3, 2], [10, 10], 4, 1.0, 6) == (1, 2, 3, 4, 5, 5)
    # two slots free: the first two in line hold them already; the third waits for the 1 s one
    assert slot_releases([5, 1], [10, 10, 10], 4, 1.0, 4) == (1, 5, 6, 7)
    assert released_wait_s((1.0, 2.0), 0, 4.0, 2, 0.0) == 0.0  # a free slot
    assert released_wait_s((1.0, 2.0), 2, 4.0, 2, 0.0) == 2.0
    assert released_wait_s((1.0, 2.0), 4, 4.0, 2, 0.0) == 2.0 + 2 * 4.0 / 2  # past the known: the mean drain


def test_on_a_lognormal_queue_the_releases_are_exact_where_the_mean_drain_is_not() -> None:
    """A FIFO engine of 4 slots, lognormal lengths (σ 1), at most 8 in line: the releases from the
    exact remaining decodes predict every wait; the mean drain (``slot_wait_s`` on the ledger's mean
    remaining) misses the median one by more than 5 %."""
    rnd = random.Random(3)
    slots, now, arrive = 4, 0.0, 0.0
    running: list[float] = []  # end times
    line: list[tuple[float, float, float, float]] = []  # (arrived, length, by releases, by mean drain)
    errors: dict[str, list[float]] = {"releases": [], "mean": []}
    while len(errors["releases"]) < 3000:
        if running and running[0] < arrive:
            now = heapq.heappop(running)
        else:
            now, arrive = arrive, arrive + rnd.expovariate(2 * slots / 40.0)
            length = max(2.0, min(400.0, 24 * math.exp(rnd.gauss(0, 1.0))))
            if len(line) < 8:
                rest = [end - now for end in running]
                ahead = [l for _, l, _, _ in line]
                beyond = len(rest) + len(ahead) + 1 - slots
                rel = slot_releases(rest, ahead, slots, length, max(1, beyond)) if beyond > 0 else ()
                mean = (sum(rest) + sum(ahead)) / max(1, len(rest) + len(ahead))
                line.append((now, length, released_wait_s(rel, beyond, length, slots, 0.0),
                             slot_wait_s(len(rest) + len(ahead), slots, mean)))
        while line and len(running) < slots:
            arrived, length, by_rel, by_mean = line.pop(0)
            waited = now - arrived
            heapq.heappush(running, now + length)
            if waited > 1.0:
                errors["releases"].append(abs(by_rel - waited) / waited)
                errors["mean"].append(abs(by_mean - waited) / waited)
    assert statistics.median(errors["releases"]) < 1e-9
    assert statistics.median(errors["mean"]) > 0.05


def _ticket(expected: float, running: bool) -> Ticket:
    p = Placement((), "e", 10, 10, 0.0, 0.1, expected_out=expected, decode_engine="e")
    return Ticket(p, ("e",), prefill_done=running, decode_engine="e", decode_charged=expected)


def test_an_engines_tickets_make_its_releases() -> None:
    """Past its first token a ticket holds a slot for its remaining decode; before it, it is in
    line for a first step and its whole decode; other clients' requests hold slots for a mean
    service; nothing while a slot is free for the next request."""
    held = [_ticket(10, True), _ticket(40, True)]
    line = [_ticket(20, False)]
    # 2 slots, TPOT 0.01 s, first step 0.05 s: slots free at 0.1 and 0.4 s; the one in line takes
    # the first (0.1 + 0.05 + 0.2 = 0.35), the next request the one at 0.35
    rel = releases(held + line, 2, 0, 0.05, 0.01, 1.0, now=0.0)
    assert rel[:3] == pytest.approx((0.1, 0.35, 0.4))
    assert releases(held, 3, 0, 0.05, 0.01, 1.0, now=0.0) == ()  # a free slot for the next one
    assert releases(held, 3, 1, 0.05, 0.01, 1.0, now=0.0)[0] == pytest.approx(0.1)  # another client's fills it


def test_a_decision_reads_the_releases_at_its_place_in_line() -> None:
    full = dict(inflight=10, slots=8, decode_tokens=10 * 500.0)
    mean = placed(view(engine("a", **full)), Ask(100, 30.0))
    by_rel = placed(view(engine("a", releases=tuple(NOW + r for r in (0.2, 0.3, 0.9, 1.5)), **full)), Ask(100, 30.0))
    assert by_rel.slot_wait_s == pytest.approx(0.9)  # third beyond the 8 slots
    assert by_rel.predicted_s == pytest.approx(mean.predicted_s - mean.slot_wait_s + 0.9)


def _one_engine(slots: int) -> tuple[SchedulerService, Clock]:
    """A predictive scheduler over one engine ``u`` of ``slots`` sequences, TPOT 0.01 s, TTFT
    0.05 s + 1 ms a token (10-token prompts: 0.01 s each), every grant checked."""
    clock = Clock()
    cfg = NarwhalConfig.model_validate({
        "admission": {"mode": "predictive"},
        "engines": [{"name": "u", "url": "http://127.0.0.1:1", "role": "unified", "max_num_seqs": slots}],
    })
    svc = SchedulerService(cfg, clock=clock)
    svc.check_views = True  # every incremental grant checked against the engines read anew
    e = svc.engines["u"]
    e.healthy, e.last_ok = True, clock.t
    svc.router.started = True
    e.tpot_model.samples.append((float(slots), 0.01))
    e.tpot_model.a, e.tpot_model.b = 0.01, 0.0
    e.ttft_model.a, e.ttft_model.b, e.ttft_model.c = 0.05, 0.001, 0.0
    return svc, clock


async def test_the_scheduler_grants_releases_from_the_tickets_on_each_engine() -> None:
    svc, clock = _one_engine(2)

    def facts() -> tuple[float, ...]:  # (from now: the facts carry them as times)
        return tuple(r - clock.t for r in svc.view(clock.t, frozen=True).facts()["u"].releases)

    for i, out in enumerate((10, 40, 20)):
        res = await svc.admit(AdmitRequest(f"t{i}", clock.t + 60, 10, out, 30.0, kind="completion",
                                           min_output_tokens=out))
        assert res.error is None
    # none past its first token: t0 and t1 hold the two slots for their whole service (prefilled
    # one after the other), t2 (the first beyond them) gets t0's when it ends, the next request
    # the earlier of t1's and t2's end
    rel = facts()
    assert rel[0] == pytest.approx(0.01 + 0.05 + 0.10)
    assert rel[1] == pytest.approx(0.16 + 0.01 + 0.05 + 0.20)
    svc.report(Report(decode_started=[("t0", ("u",)), ("t1", ("u",))], progress={"t0": 5, "t1": 5}))
    rel = facts()  # t0, t1 decoding (5 and 35 to go): t2 gets t0's slot, the next one t2's
    assert rel[0] == pytest.approx(0.05)
    assert rel[1] == pytest.approx(0.05 + 0.01 + 0.05 + 0.20)
    for tid in ("t0", "t1"):
        svc.report(Report(released=[(tid, RelayStats("single", ("u",), 0.05, 10, 0.1, 1), True)]))
    assert facts() == ()  # one in flight, two slots: no line
    svc.report(Report(released=[("t2", None, False)]))
    assert svc._decoding == {}


def test_a_release_runs_down_from_when_its_tokens_were_counted() -> None:
    """A running ticket's remaining decode is counted from when its tokens were (its first token,
    its last progress), not from when the facts are read: the releases are times, the same
    whenever they are read, and a decision later in a view's life waits only for what is left.
    (They were durations from the read: between two progress reports each read, and a lease
    deciding a second after its grant, waited for decode that had run already — the Mooncake
    replay at 2x over-predicted slot waits by 80 %.)"""
    t0 = _ticket(10, True)  # 10 tokens to go at 0.01 s: free 0.1 s after they were counted
    t0.charged_at = NOW
    t1 = _ticket(40, True)
    t1.charged_at = NOW + 0.05
    line = [_ticket(20, False)]
    at_count = releases([t0, t1] + line, 2, 0, 0.05, 0.01, 1.0, now=NOW + 0.05)
    later = releases([t0, t1] + line, 2, 0, 0.05, 0.01, 1.0, now=NOW + 0.08)
    assert at_count[0] == pytest.approx(NOW + 0.1) and later == pytest.approx(at_count)
    assert at_count[1] == pytest.approx(NOW + 0.1 + 0.05 + 0.2)  # the one in line: the first slot, then its service
    # a decision reads them at its own time: 0.03 s later, the wait is 0.03 s shorter; once due, none
    full = dict(inflight=10, slots=8, decode_tokens=10 * 500.0)
    facts = engine("a", releases=(NOW + 0.2, NOW + 0.3, NOW + 0.9), **full)
    assert decide(view(facts), Ask(100, 30.0), NOW + 0.03, 0).slot_wait_s == pytest.approx(0.87)  # type: ignore[union-attr]
    late = view(engine("a", releases=(NOW + 0.2, NOW + 0.3), inflight=9, slots=8, decode_tokens=4500.0))
    assert decide(late, Ask(100, 30.0), NOW + 0.5, 0).slot_wait_s == 0.0  # type: ignore[union-attr]
    # a ticket past its expected length still holds its slot: for a quarter of what it made (the
    # ledger's own correction, remaining_tokens), never none (a free slot it does not have, which
    # a request then in line would teach the prefill model as its prefill)
    overdue = releases([t0, _ticket(40, True), _ticket(20, False)], 2, 0, 0.05, 0.01, 1.0, now=NOW + 0.5)
    assert overdue[0] == pytest.approx(NOW + 0.5 + 0.25 * 50 * 0.01)


async def test_the_scheduler_counts_a_running_tickets_decode_from_its_progress() -> None:
    svc, clock = _one_engine(1)
    for i in range(2):
        res = await svc.admit(AdmitRequest(f"t{i}", clock.t + 60, 10, 50, 30.0, kind="completion", min_output_tokens=50))
        assert res.error is None
    svc.report(Report(decode_started=[("t0", ("u",))], progress={"t0": 10}))  # 40 to go: 0.4 s from now
    counted = clock.t
    [first, *_] = svc.view(clock.t, frozen=True).facts()["u"].releases
    assert first == pytest.approx(counted + 0.4)
    clock.t += 0.3  # (a full read: every engine read again)
    assert svc.view(clock.t, frozen=True).facts()["u"].releases[0] == pytest.approx(counted + 0.4)
    svc.report(Report(progress={"t0": 45}))  # it ran faster: 5 to go
    assert svc.view(clock.t, frozen=True).facts()["u"].releases[0] == pytest.approx(clock.t + 0.05)

