"""An engine with no TTFT measurement of its own is projected with the fleet's measured model (fitted
to every measurement of the engines of its role and dialect, pooled), not the generic prior; an operator's prior for
an engine still wins; at its first measurement the engine's model starts from the fleet's.  At a
thousand engines most have no measurement for a long while: with the generic prior (0.2 ms per
token) a fast fleet refused long prompts as over the budget on their own."""

from __future__ import annotations

import pytest

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.prediction.ttft import PRIOR_B
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.scheduler.service import SchedulerService
from narwhal_serve.telemetry import Histogram

NOW = 1000.0


def _service() -> SchedulerService:
    cfg = NarwhalConfig.model_validate({
        "admission": {"mode": "predictive"},
        "engines": [{"name": n, "url": f"http://127.0.0.1:{1 + i}"} for i, n in enumerate("abc")]
        + [{"name": "d", "url": "http://127.0.0.1:4", "ttft_prior_b_s_per_token": 0.001}],
    })
    svc = SchedulerService(cfg, clock=lambda: NOW)
    for e in svc.engines.values():
        e.healthy, e.last_ok = True, NOW
    svc.router.started = True
    return svc


def _measure(engines: dict[str, EngineState], name: str, tokens: int, ttft: float) -> None:
    e = engines[name]
    route = RouteChoice(kind="single", decode=e.cfg)
    p = Placement((route,), name, tokens, tokens, 0.0, None, ttft_budget_s=10.0)
    learn_from(RelayStats("single", (name,), ttft, 2, 0.01, 1), p, engines,
               {"ttft": Histogram((1.0,)), "tpot": Histogram((1.0,))})


def test_cold_engines_are_projected_with_the_fleets_model_and_start_from_it() -> None:
    svc = _service()
    for i in range(12):  # engine a: 10 ms + 10 µs per token
        tokens = 500 + 1000 * i
        _measure(svc.engines, "a", tokens, 0.01 + 1e-5 * tokens)
    a = svc.engines["a"].ttft_model
    assert abs(a.b - 1e-5) < 2e-6
    facts = {f.cfg.name: f for f in svc.view(NOW).engines}
    assert (facts["b"].ttft_a, facts["b"].ttft_b) == (a.a, a.b) == (facts["c"].ttft_a, facts["c"].ttft_b)
    assert facts["d"].ttft_b == 0.001  # its operator's prior
    # a 12,000-token prompt, 2 s target, engine a out: the generic prior says 2.4 s alone
    assert 12_000 * PRIOR_B > 2.0
    svc.engines["a"].healthy = False
    verdict = decide(svc.view(NOW), Ask(prompt_tokens=12_000, ttft_budget_s=2.0), NOW, 0)
    assert isinstance(verdict, Placement), verdict
    assert verdict.first_engine in ("b", "c") and verdict.predicted_s is not None and verdict.predicted_s < 0.5
    svc.engines["b"].healthy = svc.engines["c"].healthy = False  # only d: its own (slow) prior holds
    assert isinstance(decide(svc.view(NOW), Ask(prompt_tokens=12_000, ttft_budget_s=2.0), NOW, 0), Refusal)
    # b's first measurement: its model starts from a's, prior included
    _measure(svc.engines, "b", 4000, 0.01 + 1e-5 * 4000)
    b = svc.engines["b"].ttft_model
    assert (b.prior_a, b.prior_b) == (a.a, a.b) and len(b.samples) == 1
    assert abs(b.b - 1e-5) < 3e-6


def test_leases_are_granted_the_prior_as_read_with_every_engine() -> None:
    """The prior granted to leases moves with the reads of every engine (each FULL_VIEW_S), not
    with each refit of the engine it comes from: a refit changes that engine's facts only, and the
    engines borrowing it keep their facts (the same objects: no row re-sent) until the next read."""
    from narwhal_serve.scheduler.granted import FULL_VIEW_S

    svc = _service()
    for i in range(12):
        _measure(svc.engines, "a", 500 + 1000 * i, 0.01 + 1e-5 * (500 + 1000 * i))
    first = {f.cfg.name: f for f in svc.view(NOW, frozen=True).engines}
    a = svc.engines["a"].ttft_model
    assert (first["b"].ttft_a, first["b"].ttft_b) == (a.a, a.b)
    for i in range(6):  # a slows down: refitted with each measurement
        _measure(svc.engines, "a", 8000 + 500 * i, 0.05 + 4e-5 * (8000 + 500 * i))
    svc.touch("a")
    later = {f.cfg.name: f for f in svc.view(NOW + FULL_VIEW_S / 2, frozen=True).engines}
    assert later["a"].ttft_b == a.b != first["a"].ttft_b
    assert later["b"] is first["b"] and later["c"] is first["c"]  # still the prior as read
    assert svc.view(NOW + FULL_VIEW_S / 2).engines[1].ttft_b == a.b  # the scheduler's own view: as it is
    read = {f.cfg.name: f for f in svc.view(NOW + FULL_VIEW_S, frozen=True).engines}
    assert (read["b"].ttft_a, read["b"].ttft_b, read["b"].ttft_c) == (a.a, a.b, a.c) == (read["c"].ttft_a, read["c"].ttft_b, read["c"].ttft_c)
    assert read["d"].ttft_b == 0.001


def test_the_first_measurement_of_a_kind_is_granted_at_once() -> None:
    """Before any measurement leases are granted the generic prior; the fleet's first measurement
    reaches the engines borrowing it with the next grant, not a FULL_VIEW_S later (a fast fleet
    would refuse long prompts as over the budget on their own meanwhile)."""
    svc = _service()
    cold = {f.cfg.name: f for f in svc.view(NOW, frozen=True).engines}
    assert cold["b"].ttft_b == PRIOR_B
    for i in range(3):
        _measure(svc.engines, "a", 500 + 1000 * i, 0.01 + 1e-5 * (500 + 1000 * i))
    svc.touch("a")
    warm = {f.cfg.name: f for f in svc.view(NOW + 0.001, frozen=True).engines}
    a = svc.engines["a"].ttft_model
    assert (warm["b"].ttft_a, warm["b"].ttft_b) == (warm["c"].ttft_a, warm["c"].ttft_b) == (a.a, a.b) != (cold["b"].ttft_a, PRIOR_B)


def test_an_engines_first_measurement_at_the_scheduler_starts_from_the_prior_it_was_granted(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The scheduler learns an engine's first measurement from the prior it granted with the last
    read of every engine (what the engine was projected with until then), not from a look at every
    engine for the best-measured one (at a thousand engines, a scan per engine's first measurement:
    a third of the report handling's learning)."""
    from narwhal_serve.placement import engines as engines_mod

    svc = _service()
    for i in range(12):
        _measure(svc.engines, "a", 500 + 1000 * i, 0.01 + 1e-5 * (500 + 1000 * i))
    granted = {f.cfg.name: f for f in svc.view(NOW, frozen=True).engines}["b"]
    for i in range(6):  # a refitted since: the prior as granted is older than a's model
        _measure(svc.engines, "a", 8000 + 500 * i, 0.05 + 4e-5 * (8000 + 500 * i))
    assert svc.engines["a"].ttft_model.b != granted.ttft_b

    def no_scan(engines):  # type: ignore[no-untyped-def]
        raise AssertionError("looked at every engine")

    monkeypatch.setattr(engines_mod, "fleet_ttft", no_scan)
    b = svc.engines["b"]
    route = RouteChoice(kind="single", decode=b.cfg)
    p = Placement((route,), "b", 4000, 4000, 0.0, None, ttft_budget_s=10.0)
    tid = "t-b"
    svc._placed(tid, p, NOW + 60, None)
    svc._release(tid, RelayStats("single", ("b",), 0.01 + 1e-5 * 4000, 2, 0.01, 1), completed=True)
    m = b.ttft_model
    assert (m.prior_a, m.prior_b) == (granted.ttft_a, granted.ttft_b) and len(m.samples) == 1


def test_engines_first_measured_before_their_kind_is_granted_start_from_the_fleets_model() -> None:
    """Before the prior of a role and dialect has been granted (a scheduler just started, or two
    engines of a new kind measured in one report), an engine's first measurement looks at every
    engine for the fleet's model, as before there was a granted prior."""
    svc = _service()
    for name, ttft in (("a", 0.05), ("b", 0.06)):  # one report: no grant between them
        e = svc.engines[name]
        p = Placement((RouteChoice(kind="single", decode=e.cfg),), name, 4000, 4000, 0.0, None, ttft_budget_s=10.0)
        svc._placed(f"t-{name}", p, NOW + 60, None)
        svc._release(f"t-{name}", RelayStats("single", (name,), ttft, 2, 0.01, 1), completed=True)
    a, b = svc.engines["a"].ttft_model, svc.engines["b"].ttft_model
    assert len(a.samples) == len(b.samples) == 1
    assert (b.prior_a, b.prior_b) == (a.a, a.b) and a.prior_b == PRIOR_B != b.prior_b  # b from a's model


def test_the_fleets_model_is_fitted_to_every_engines_measurements_pooled() -> None:
    """Two engines measured over different prompt lengths, each alone a poor guide (a: short
    prompts only, its slope held near the generic prior; b: a few long ones): the prior for the
    others is the fit to all their samples together (their windows' sums added), not the model of
    the one with more samples.  (At 1,000 engines in the Mooncake replay the one-engine prior moved
    by a third at each refit and halved the TTFT prediction error's median when pooled.)"""
    from narwhal_serve.placement.engines import fleet_ttft
    from narwhal_serve.prediction.ttft import PrefillModel

    svc = _service()
    truth = lambda x: 0.01 + 2e-5 * x  # noqa: E731
    for i in range(20):
        _measure(svc.engines, "a", 50 + 5 * i, truth(50 + 5 * i))
    for x in (6000, 12000, 24000):
        _measure(svc.engines, "b", x, truth(x))
    pooled = PrefillModel()
    for x, r, ttft in (*svc.engines["a"].ttft_model.samples, *svc.engines["b"].ttft_model.samples):
        pooled.observe(x, ttft, r)
    prior = fleet_ttft(svc.engines.values())[("unified", "vllm")]
    assert prior == pytest.approx((pooled.a, pooled.b, pooled.c), rel=1e-9, abs=1e-12)
    assert abs(prior.b - 2e-5) < 1e-6 and abs(svc.engines["a"].ttft_model.b - 2e-5) > 5e-6  # a alone: far off
    facts = {f.cfg.name: f for f in svc.view(NOW, frozen=True).engines}
    assert (facts["c"].ttft_a, facts["c"].ttft_b, facts["c"].ttft_c) == tuple(prior)


def test_a_prior_that_moved_less_than_its_tolerance_is_not_granted_again() -> None:
    """Each new prior is a new row for every engine borrowing it to every lease: one that projects
    within 1 % + 5 ms of the granted one for every prompt up to 128 k tokens behind up to 8
    requests keeps the granted one (the same object); one that moved more replaces it."""
    from narwhal_serve.placement.engines import PRIOR_FLOOR_S, PRIOR_SPAN, PriorCoeffs, settled_prior

    kept = PriorCoeffs(0.02, 2e-5, 0.01)
    assert settled_prior(None, kept) is kept
    assert settled_prior(kept, PriorCoeffs(0.021, 2.01e-5, 0.0101)) is kept
    for moved in (PriorCoeffs(0.02 + 2 * PRIOR_FLOOR_S, 2e-5, 0.01),  # at the shortest prompt
                  PriorCoeffs(0.02, 2.1e-5, 0.01),  # 5 % at the longest
                  PriorCoeffs(0.02, 2e-5, 0.01 + 3 * PRIOR_FLOOR_S / PRIOR_SPAN[1])):  # behind requests
        assert settled_prior(kept, moved) is moved
