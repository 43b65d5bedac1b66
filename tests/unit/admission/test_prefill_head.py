"""A request placed behind prompts pending at an engine waits for what is left of them: the one at
the head of the line has been prefilling since it became the head, so part of it is done.  Counting
it whole over-predicted every request placed during a long prefill (on the simulator's shared
prefixes, a group's second request sent 0.5 s into its first's 0.9 s prefill was predicted at
0.98 s and came at 0.43 s), and those over-predicted samples taught the prefill model too flat a
slope: short prompts then over-predicted by about 12 % (docs/performance.md, *The head of the
line*)."""

from __future__ import annotations

import pytest

from narwhal_serve.admission.core import Ask
from narwhal_serve.admission.facts import EngineDelta
from narwhal_serve.admission.view import Placement
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from narwhal_serve.telemetry import Histogram
from tests.support.scheduler import scheduler_service
from tests.unit.admission.test_overload_decisions import NOW, engine, placed, view


def test_the_head_of_the_line_is_counted_less_what_it_prefilled_since_it_started() -> None:
    # 3,000 tokens pending: the head's 2,000 and 1,000 behind it; 0.2 ms a token
    line = dict(pending_prefill_tokens=3000, pending_prefill_requests=2, line_head_tokens=2000)
    whole = placed(view(engine("e", **line)), Ask(100, 30.0))
    assert whole.x_tokens == 3100  # the head's start not known: all of it ahead
    started = placed(view(engine("e", line_since=NOW - 0.22, **line)), Ask(100, 30.0))
    # 0.22 s in, 0.2 s past its a (0.02 s): 1,000 of its 2,000 tokens done
    assert started.x_tokens == 2100
    assert started.predicted_s == pytest.approx(0.02 + 0.0002 * 2100)
    assert placed(view(engine("e", line_since=NOW - 0.015, **line)), Ask(100, 30.0)).x_tokens == 3100  # within its a
    # past its own length the head counts as done, never more (the next one's start is not known)
    late = placed(view(engine("e", line_since=NOW - 5.0, **line)), Ask(100, 30.0))
    assert late.x_tokens == 1100
    # a lease's view is in the scheduler's clock: shifted into the holder's, the same wait
    shifted = placed(view(engine("e", line_since=NOW - 7.22, **line), shift=7.0), Ask(100, 30.0))
    assert shifted.x_tokens == 2100


def test_a_holder_whose_own_prefill_finished_since_the_view_no_longer_knows_the_head() -> None:
    f = engine("e", pending_prefill_tokens=3000, pending_prefill_requests=2, line_head_tokens=2000,
               line_since=NOW - 0.2)
    placed_behind = f.plus(EngineDelta(inflight=1, pending_prefill_tokens=100, pending_prefill_requests=1))
    assert placed_behind.line_since == f.line_since  # placing behind it leaves the head as it was
    finished = f.plus(EngineDelta(inflight=1, pending_prefill_tokens=-2000, pending_prefill_requests=-1,
                                  prefills_done=1))
    assert finished.line_since is None and finished.prefilled_tokens(NOW) == 0.0


async def test_the_scheduler_keeps_the_line_and_when_its_head_started() -> None:
    svc, clock = scheduler_service({"mode": "predictive", "queue_limit": 4, "phase_concurrency": {"prefill": 8, "decode": 8}})
    for name in ("p", "d"):
        svc.deregister_engine(name)
    u = svc.engines["u"]
    t0 = clock.t
    assert (await svc.admit(AdmitRequest("a", t0 + 60, 300, 4, 30.0))).error is None
    clock.t += 0.1
    assert (await svc.admit(AdmitRequest("b", t0 + 60, 500, 4, 30.0))).error is None
    assert u.line_since == t0 and list(u.prefill_line.values()) == [300, 500]
    facts = svc.view(clock.t).facts()["u"]
    assert (facts.line_since, facts.line_head_tokens) == (t0, 300)
    clock.t += 0.2
    svc.report(Report(decode_started=[("a", ("u",))]))  # a's first token: b is the head from now
    assert u.line_since == clock.t and list(u.prefill_line.values()) == [500]
    assert svc.view(clock.t).facts()["u"].line_head_tokens == 500
    svc.report(Report(released=[("b", None, False)]))  # b ends before its first token: no line
    assert u.line_since is None and not u.prefill_line
    svc.report(Report(released=[("a", None, False)]))
    assert u.pending_prefill_tokens == 0 and u.inflight == 0


def test_a_request_behind_a_head_counted_as_partly_prefilled_does_not_teach_the_model() -> None:
    """Its x is net of an estimate from when the head started (in the scheduler's hearing, a report
    late); taught back to the model, that estimate's error fed on itself and drove the model's
    intercept to nothing on the simulator's shared prefixes (docs/performance.md)."""
    cfg = EngineConfig(name="e", url="http://127.0.0.1:9", role="unified")
    e = EngineState(cfg)
    hists = {k: Histogram() for k in ("ttft", "tpot", "ttft_prediction_error", "ttft_predicted")}
    route = RouteChoice(kind="single", decode=cfg)
    behind = Placement((route,), "e", 100, 1100, 0.0, 0.25, r_ahead=1, head_done=1000)
    learn_from(RelayStats("single", ("e",), 0.3, 20, 0.2, 1), behind, {"e": e}, hists)
    assert not e.ttft_model.samples and hists["ttft_prediction_error"].n == 1
    whole = Placement((route,), "e", 100, 1100, 0.0, 0.25, r_ahead=1)
    learn_from(RelayStats("single", ("e",), 0.3, 20, 0.2, 1), whole, {"e": e}, hists)
    assert len(e.ttft_model.samples) == 1


async def test_a_request_in_line_leaving_a_full_engine_frees_no_slot_for_the_head() -> None:
    """Every slot decoding (others' requests here): the head waits, and neither a request behind
    it nor the head itself leaving gives the line a start; a slot freeing does."""
    svc, clock = scheduler_service({"mode": "predictive", "queue_limit": 4, "phase_concurrency": {"prefill": 8, "decode": 8}})
    for name in ("p", "d"):
        svc.deregister_engine(name)
    u = svc.engines["u"]
    u.cfg = u.cfg.model_copy(update={"max_num_seqs": 3})
    assert (await svc.admit(AdmitRequest("x", clock.t + 60, 10, 4, 30.0))).error is None
    svc.report(Report(decode_started=[("x", ("u",))]))  # x decodes: one slot of ours
    u.load, u.inflight_at_scrape = EngineLoad(running=2), u.inflight - 1  # two slots others' (as scraped)
    assert u.in_flight() == 3
    for tid in ("c", "d", "f"):
        assert (await svc.admit(AdmitRequest(tid, clock.t + 60, 500, 4, 30.0))).error is None
    assert list(u.prefill_line) == ["c", "d", "f"] and u.line_since is None  # c waits for a slot
    clock.t += 0.1
    svc.report(Report(released=[("d", None, False)]))  # one in line leaves: no slot freed
    assert u.line_since is None
    svc.report(Report(released=[("c", None, False)]))  # the head leaves: f is the head, and waits
    assert list(u.prefill_line) == ["f"] and u.line_since is None
    clock.t += 0.1
    svc.report(Report(released=[("x", None, False)]))  # a decoding request ends: f has its slot
    assert u.line_since == clock.t
