"""The idle margin (tests/unit/admission/test_idle_margin.py) where a review of it found it wrong;
each test failed before its fix, for the reason given:

1. P/D: the route's "decoding" count was taken at its prefill engine (its in-flight less its
   pending prefills); the ledger charges in-flight to every engine of a route until the request
   ends, so a P/D prefill engine counted every request it had prefilled that now decodes on
   *another* engine: with nothing to prefill and the route's decode engine idle, never idle (the
   projection judged with the margin of all errors, a Retry-After loop; the idle window never
   learned there).  Now counted at the route's decode engine.
2. The scheduler granted the idle window's margin, the prior (0.25) while it held no error: an
   engine only ever measured busy judged the prompt alone harsher than its learned margin judged
   the same request loaded (refused for good where the build before admitted it).  Now the margin
   of all errors until 16 idle errors are in.
3. docs/contract.md said ``/status`` shows each engine's ``decoding_requests``: it did not.
4. A managed engine's extra slot (Serve starts a replacement before the old replica stops) was made
   without the configured confidence (and prefix index capacity) every other engine gets.
"""

from __future__ import annotations

from typing import Any

from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.admission.ledger import Ticket, admitted, first_token
from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.learning import learn_from
from narwhal_serve.scheduler.service import SchedulerService
from tests.unit.admission.test_idle_margin import one_engine_service
from tests.unit.admission.test_overload_decisions import NOW, engine, view


def _pd(name: str, role: str, **kw: Any):
    return engine(name, cfg=EngineConfig(name=name, url=f"http://127.0.0.1:{abs(hash(name)) % 1000 + 1}",
                                         role=role, dialect="vllm"), **kw)


def test_pd_prefill_engine_with_nothing_to_prefill_and_an_idle_decode_engine_is_idle() -> None:
    # one request went p -> d1 and is past its first token (decoding on d1): what the ledger
    # leaves on p is in-flight 1, nothing pending
    p, d1, d2 = _pd("p", "prefill", slots=None), _pd("d1", "decode"), _pd("d2", "decode")
    first = decide(view(p, d1, d2), Ask(20, 2.0), NOW, 0)
    assert isinstance(first, Placement) and first.first_engine == "p"
    t = Ticket(first)
    deltas = admitted(t)
    for name, d in first_token(t, first.engines).items():
        deltas[name] = deltas[name] + d
    facts = {f.cfg.name: f.plus(deltas[f.cfg.name]) if f.cfg.name in deltas else f for f in (p, d1, d2)}
    busy_decode = first.decode_engine
    assert facts["p"].inflight == 1 and facts["p"].pending_prefill_requests == 0
    # the next request: prefilled on p (nothing there to prefill, none decoding on p), decoded on
    # the other, idle decode engine
    nxt = decide(view(*facts.values()), Ask(20, 2.0), NOW, 0)
    assert isinstance(nxt, Placement) and nxt.first_engine == "p" and nxt.decode_engine != busy_decode
    assert nxt.idle, (nxt.decoding, nxt.x_tokens, nxt.r_ahead, nxt.slot_wait_s)


def test_pd_idle_route_is_judged_with_the_idle_margin_not_refused_with_a_retry_after() -> None:
    # p has 3 requests it prefilled decoding on d1 (in-flight 3, none pending); d2 is idle.
    # Prompt alone 0.62 s: 0.682 s with the idle margin 0.1 (admitted at 1.0 s), 1.24 s with 1.0
    p = _pd("p", "prefill", slots=None, inflight=3, ttft_a=0.02, ttft_b=0.002, ttft_margin=1.0,
            ttft_idle_margin=0.1)
    d1, d2 = _pd("d1", "decode", inflight=3), _pd("d2", "decode")
    out = decide(view(p, d1, d2), Ask(300, 1.0, exact=True), NOW, 0)
    assert isinstance(out, Placement), out.error  # refused ttft_budget_exceeded, Retry-After: 1


def test_an_engine_never_seen_idle_is_not_judged_with_the_idle_prior_over_its_learned_margin() -> None:
    svc, e = one_engine_service()
    # only ever served beside requests decoding (a steady stream), predicted to the millisecond
    for _ in range(256):
        e.inflight = 4
        p = decide(svc.view(NOW), Ask(prompt_tokens=20, ttft_budget_s=2.0), NOW, 0)
        assert isinstance(p, Placement) and p.predicted_s is not None and not p.idle
        e.inflight = 0
        learn_from(RelayStats("single", ("u",), p.predicted_s, 2, 0.01, 1), p, svc.engines, svc.histograms)
    assert e.ttft_errors.margin < 0.03 and not e.ttft_idle_errors.errors  # (0.25: the prior, nothing learned)
    alone = e.ttft_model.predict(20)
    budget = alone + 0.1 * 0.25  # met with the learned margin, not with the prior's 0.25 · 0.25 s
    e.inflight = 4  # still busy: the projection (the prompt alone, beside those decoding) meets it
    out = decide(svc.view(NOW), Ask(prompt_tokens=20, ttft_budget_s=budget), NOW, 0)
    # before the idle margin: admitted; now refused for good (x-should-retry: false), and as
    # refusals teach nothing and the engine is never idle, for as long as it stays busy
    assert isinstance(out, Placement), out.error


def test_status_shows_each_engine_s_decoding_requests_as_the_contract_says() -> None:
    svc, e = one_engine_service()
    e.inflight = 3
    v = e.view(NOW, 5.0, frozenset())
    flat = {**v, **(v.get("ttft_model") or {})}  # type: ignore[dict-item]
    assert "decoding_requests" in flat, sorted(flat)


def test_an_extra_managed_slot_gets_the_configured_confidence_for_both_error_windows() -> None:
    # (pre-existing for ttft_errors; the new window copies the omission) ManagedFleet.register's
    # extra slot (Serve starts a replacement before the old replica stops) is an EngineState made
    # without what state.py / admin.py set on every other engine
    from narwhal_serve.managed.slot import ReplicaReport

    cfg = NarwhalConfig.model_validate({"admission": {"mode": "predictive", "ttft_confidence": 0.9},
                                        "engines": [{"name": "m", "role": "unified",
                                                     "launch": {"kind": "sim", "replicas": 1}}]})
    svc = SchedulerService(cfg, clock=lambda: NOW)

    def rep(replica: str, port: int) -> ReplicaReport:
        return ReplicaReport(engine="m", replica=replica, url=f"http://10.0.0.1:{port}", node_id="n",
                             node_ip="10.0.0.1", accelerator_ids=("0",), pid=port, log="/tmp/x.log", ready_s=1.0)

    assert svc.managed.register(rep("r1", 8001), NOW)[0] == "m"
    extra, _ = svc.managed.register(rep("r2", 8002), NOW)  # r1 still live: an extra slot
    assert extra != "m"
    e = svc.engines[extra]
    assert (e.ttft_errors.quantile, e.ttft_idle_errors.quantile) == (0.9, 0.9)
