"""Slot waits beside other clients' requests, and the margins of an engine back from drift (from a
review of the TTFT projection; each test failed before its fix)."""

from __future__ import annotations

from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.admission.ledger import releases
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.drift import ProfileErrors
from narwhal_serve.prediction.ttft import MARGIN_PRIOR, released_wait_s, slot_wait_s
from narwhal_serve.scheduler.health import update_drift
from narwhal_serve.scheduler.service import SchedulerService

NOW = 1000.0


def _service(engines: list[dict[str, object]]) -> SchedulerService:
    cfg = NarwhalConfig.model_validate({"admission": {"mode": "predictive"}, "engines": engines})
    svc = SchedulerService(cfg, clock=lambda: NOW)
    for e in svc.engines.values():
        e.healthy, e.last_ok = True, NOW
    svc.router.started = True
    return svc


def test_other_clients_requests_waiting_for_a_slot_do_not_hold_one() -> None:
    """Other clients' requests (running *and* waiting, EngineState.external) were all taken as
    slot holders, so an engine of 1 slot with another client's request running and one waiting was
    modelled with 2 slots.  Right: at most ``slots`` sequences run (the contract, "Admission": the
    requests there beyond its max_num_seqs wait); the waiting one takes the slot when the running
    one ends (1 s) and holds it 1 s, so our request (2nd beyond the slot) starts at 2 s — what the
    mean drain (slot_wait_s) gives too.  The releases gave 1 s: half the wait, so a request was
    admitted that missed its budget."""
    slots, external, more_s = 1, 2, 1.0
    rel = releases([], slots, external, 0.05, 0.01, more_s, now=0.0)
    position = external + 1 - slots  # (admission/core.py _slot_wait)
    assert slot_wait_s(external, slots, more_s) == 2.0
    assert released_wait_s(rel, position, more_s, slots, 0.0) == 2.0, rel


def test_the_releases_of_an_engine_full_of_other_clients_requests_count_their_decode() -> None:
    """scheduler/state.py _releases: with none of the router's own requests there, each other
    client's request was taken to free its slot after the first step ``a`` alone (50 ms here).
    Right: they hold their slots for a mean service including its decode (ledger.releases docstring;
    admission/core.py _slot_wait falls back to the expected output, ``mean_remaining(..., expected_out)``:
    here the 128-token prior at 10 ms = 1.33 s a request, so the first place beyond 2 slots waits
    about 0.67 s by the mean drain, 1.33 s by the releases).  A 50 ms wait admitted requests that waited
    seconds (now: the mean output learned, else the prior)."""
    svc = _service([{"name": "u", "url": "http://127.0.0.1:1", "role": "unified", "max_num_seqs": 2}])
    e = svc.engines["u"]
    e.tpot_model.samples.append((2.0, 0.01))
    e.tpot_model.a, e.tpot_model.b = 0.01, 0.0
    e.ttft_model.a, e.ttft_model.b, e.ttft_model.c = 0.05, 0.001, 0.0
    e.load = EngineLoad(running=2, waiting=0)  # another client's two requests fill both slots
    p = decide(svc.view(NOW), Ask(10, 30.0, kind="completion"), NOW, 0)
    assert isinstance(p, Placement), p
    assert p.slot_wait_s > 0.6, (p.slot_wait_s, svc.view(NOW).facts()["u"].releases)


def test_an_engine_back_from_drift_is_not_judged_with_the_margin_of_the_models_it_dropped() -> None:
    """scheduler/health.py update_drift restarted an engine's TTFT and TPOT models from their priors
    but kept ``ttft_errors`` and ``ttft_idle_errors`` — the errors of the discarded models, which
    are what took it out (learn_from does not touch them while it is out, so they stay frozen).
    Right (contract, "Drift": its models "restart from their priors" and, back, it "is projected
    truthfully"; the margin is shown as ``ttft_model.margin``): the margins restart from their prior
    (MARGIN_PRIOR) too.  Kept, an engine back in rotation judges even a tiny prompt alone with a
    margin at its cap: 20 tokens (24 ms) against a 0.2 s target are refused
    ``prompt_exceeds_ttft_budget`` (``x-should-retry: false``) on an idle engine — the failure the
    idle margin was built to prevent (contract, "Confidence")."""
    svc = _service([{"name": "u", "url": "http://127.0.0.1:1", "role": "unified"},
                    {"name": "v", "url": "http://127.0.0.1:2", "role": "unified"}])
    u = svc.engines["u"]
    for _ in range(256):  # the slowness that took it out: measured 4x what its model predicted
        u.ttft_errors.observe(2.0, 0.5)
        u.ttft_idle_errors.observe(2.0, 0.5)
    u.drift.ttft = 1.5
    assert update_drift(svc.engines, NOW, svc.cfg) == ["u"]
    assert not u.ttft_model.samples  # the model restarted
    # its profiles re-measure it as it is now and bring it back
    for _ in range(svc.cfg.placement.drift_probes):
        u.ttft_model.observe(200.0, 0.02 + 0.0002 * 200.0)
        u.drift.on_profile(True, ProfileErrors(0.0, 0.0), NOW, svc.cfg.placement)
    assert not u.drift.out
    svc.engines["v"].healthy = False  # (u alone: its own judgement)
    p = decide(svc.view(NOW), Ask(20, 0.2), NOW, 0)
    assert isinstance(p, Placement), (p, u.ttft_errors.margin, u.idle_margin())
    assert u.idle_margin() == MARGIN_PRIOR and u.ttft_errors.margin == MARGIN_PRIOR
