"""A request that waits for a sequence slot: the line it waits in is the engine's (its slot count
learned once and kept), the prefills ahead of it are added to its wait, and it does not teach the
prefill model."""

from __future__ import annotations

import pytest

from narwhal_serve.admission.core import Ask
from narwhal_serve.admission.view import Placement
from narwhal_serve.config import EngineConfig
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.scheduler.monitor import scraped
from narwhal_serve.telemetry import Histogram
from tests.unit.admission.test_overload_decisions import engine, placed, view


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


def test_in_line_for_a_slot_the_prefills_ahead_still_count_after_its_wait() -> None:
    """The slot wait and the prefills ahead are added, not overlapped: with long prompts (the
    Mooncake trace on the simulator) the requests in line measured their sum, and taking the later
    of the two admitted requests that came in 0.5–1.9 s late (docs/performance.md)."""
    pending = dict(pending_prefill_tokens=4000, pending_prefill_requests=4, ttft_a=0.02, ttft_b=0.0002)
    free = placed(view(engine("e", inflight=4, slots=8, **pending)), Ask(100, 30.0))
    assert free.slot_wait_s == 0.0 and free.x_tokens == 4100
    assert free.predicted_s == pytest.approx(0.02 + 0.0002 * 4100)
    in_line = placed(view(engine("e", inflight=8, slots=8, releases=(0.3,), **pending)), Ask(100, 30.0))
    assert in_line.slot_wait_s == pytest.approx(0.3) and in_line.x_tokens == 4100
    assert in_line.predicted_s == pytest.approx(0.3 + 0.02 + 0.0002 * 4100)


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
