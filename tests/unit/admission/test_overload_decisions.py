"""Admission decisions under load on constructed fleet views (admission/core.py): TPOT scoring and
the TPOT refusals, prefix-aware placement, drift penalties, learned output lengths in the slot
wait and the decode charge; and the scheduler's decode ledger as tokens arrive."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from narwhal_serve.admission.controller import Refusal
from narwhal_serve.admission.core import Ask, EngineFacts, FleetView, Placement, decide
from narwhal_serve.admission.ledger import charge
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.prefix import text_block_hashes
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from tests.support.scheduler import scheduler_service

NOW = 1000.0


def engine(name: str, **kw: Any) -> EngineFacts:
    base: dict[str, Any] = dict(
        cfg=EngineConfig(name=name, url=f"http://127.0.0.1:{abs(hash(name)) % 1000 + 1}", role="unified"),
        eligible_until=NOW + 5, inflight=0, load=EngineLoad(), pending_prefill_tokens=0, ttft_a=0.02,
        ttft_b=0.0002, slots=8, service_s=1.0, tpot_a=0.02, tpot_b=0.004, tpot_known=True,
    )
    base.update(kw)
    return EngineFacts(**base)


def view(*engines: EngineFacts, **kw: Any) -> FleetView:
    return FleetView(engines=engines, unavailable=None, predictive=True, **kw)


def placed(v: FleetView, ask: Ask) -> Placement:
    out = decide(v, ask, NOW, 0)
    assert isinstance(out, Placement), out
    return out


def refused(v: FleetView, ask: Ask) -> Refusal:
    out = decide(v, ask, NOW, 0)
    assert isinstance(out, Refusal), out
    return out


def test_lowest_projected_tpot_wins_and_routes_over_the_target_take_no_new_work() -> None:
    v = view(engine("busy", inflight=6), engine("calm", inflight=1))
    p = placed(v, Ask(100, 2.0))
    assert p.engines == ("calm",) and p.predicted_tpot_s == pytest.approx(0.02 + 0.004 * 2)
    # with a TPOT target of 35 ms the busy engine (projected 0.02 + 0.004·7 = 48 ms) is out of the routes
    p = placed(v, Ask(100, 2.0, tpot_budget_s=0.035))
    assert [r.decode.name for r in p.routes] == ["calm"]
    assert [r.decode.name for r in placed(v, Ask(100, 2.0)).routes] == ["calm", "busy"]


def test_every_route_over_the_tpot_target_is_refused_with_an_honest_retry_after() -> None:
    v = view(engine("a", inflight=6, decode_tokens=600.0), engine("b", inflight=7, decode_tokens=700.0))
    r = refused(v, Ask(100, 2.0, tpot_budget_s=0.03))
    assert r.error.code == "tpot_budget_exceeded" and r.error.status == 429
    # "a" must shed 3 of its 7 sequences (0.02 + 0.004·4 ≤ 0.03 < 0.02 + 0.004·5 ... ) at 100 tokens each
    assert r.error.retry_after is not None and r.error.retry_after >= 1
    assert "TPOT" in r.error.message


def test_a_tpot_target_no_engine_meets_even_idle_is_refused_without_retry_after() -> None:
    v = view(engine("a", tpot_a=0.05), engine("b", tpot_a=0.06))
    r = refused(v, Ask(100, 2.0, tpot_budget_s=0.03))
    assert r.error.code == "tpot_budget_unattainable" and r.error.retry_after is None
    assert r.error.headers().get("x-should-retry") == "false"  # no wait cures it: SDKs must not retry


def test_no_tpot_judgement_without_measurements_or_target() -> None:
    v = view(engine("a", inflight=7, tpot_known=False))
    assert placed(v, Ask(100, 2.0, tpot_budget_s=0.001)).predicted_tpot_s is None
    assert placed(view(engine("a", inflight=7)), Ask(100, 2.0)).engines == ("a",)


def test_prefix_holder_wins_against_load_and_the_projection_credits_its_cached_tokens() -> None:
    shared = "You are a careful assistant. " * 300  # ~8,700 characters
    hashes = text_block_hashes(shared + "question one", 256, 128)
    per_block = 256 / 4
    prompt = (len(shared) + 12) // 4
    holder = engine("holder", inflight=1, ttft_b=0.0005, prefix=frozenset(hashes))
    idle = engine("idle", ttft_b=0.0005)
    ask = Ask(prompt, 2.0, prefix=hashes, prefix_block_tokens=per_block)
    p = placed(view(holder, idle), ask)
    assert p.engines == ("holder",)
    assert p.cached_tokens == int(len(hashes) * per_block) and p.prefill_tokens == prompt - p.cached_tokens
    assert p.x_tokens == p.prefill_tokens
    blind = placed(view(holder, idle), replace(ask, prefix=()))
    assert blind.engines == ("idle",) and blind.cached_tokens == 0
    # weighed against load: the holder wins while it meets the targets, even far busier...
    assert placed(view(replace(holder, inflight=7), idle), ask).engines == ("holder",)
    # ...not once its queue would break the TTFT target, or its batch the TPOT target
    assert placed(view(replace(holder, pending_prefill_tokens=5000), idle), ask).engines == ("idle",)
    assert placed(view(replace(holder, inflight=7), idle), replace(ask, tpot_budget_s=0.04)).engines == ("idle",)
    # the prefill charge is the uncached part; its blocks count as the holder's at once (a pending
    # prefix: a request with the same prefix queues behind its prefill there and finds them cached)
    d = charge(p)["holder"]
    assert d.pending_prefill_tokens == p.prefill_tokens and d.prefix == frozenset(hashes)


def test_a_long_cached_prefix_is_not_spilled_onto_a_busy_engine() -> None:
    shared = "You are a careful assistant. " * 300
    hashes = text_block_hashes(shared + "question one", 256, 128)
    per_block = 256 / 4
    prompt = (len(shared) + 12) // 4
    ask = Ask(prompt, 2.0, prefix=hashes, prefix_block_tokens=per_block)
    # the holder's queue breaks the TTFT target; the other engine would meet it, prefilling the
    # whole prompt again, but it runs a full batch (8 of 8 slots): no spill, the holder's refusal
    holder = engine("holder", ttft_b=0.0005, prefix=frozenset(hashes), pending_prefill_tokens=5000)
    busy = engine("busy", ttft_b=0.0005, inflight=8)
    r = refused(view(holder, busy), ask)
    assert r.error.code == "ttft_budget_exceeded" and r.error.retry_after is not None
    held = decide(view(holder), ask, NOW, 0)  # the same judgement as the holder alone
    assert isinstance(held, Refusal) and held.error.retry_after == r.error.retry_after
    # an engine with a free slot takes the spill (it would idle otherwise), as before
    assert placed(view(holder, replace(busy, inflight=7)), ask).engines == ("busy",)
    # a short shared part (under half the prompt) is no reason to wait for its holder
    short = Ask(prompt * 3, 20.0, prefix=hashes, prefix_block_tokens=per_block)
    assert placed(view(replace(holder, pending_prefill_tokens=60_000), busy), short).engines == ("busy",)
    # a holder over the TPOT target: the refusal is the holder's TPOT one, not a spill onto a
    # busy engine that would meet both targets
    tpot = replace(ask, tpot_budget_s=0.04)
    r = refused(view(replace(holder, pending_prefill_tokens=0, inflight=7), replace(busy, tpot_b=0.0)), tpot)
    assert r.error.code == "tpot_budget_exceeded"
    # a guarded spill stays a fallback route after the holder (failover), never the first choice
    p = placed(view(replace(holder, pending_prefill_tokens=0), busy), ask)
    assert [r.decode.name for r in p.routes] == ["holder", "busy"]


def test_prompt_alone_refusal_counts_only_uncached_tokens() -> None:
    hashes = text_block_hashes("z" * 40_000, 256, 128)
    slow = engine("slow", ttft_b=0.001, prefix=frozenset(hashes))
    ask = Ask(10_000, 2.0, prefix=hashes, prefix_block_tokens=64.0)
    assert placed(view(slow), ask).cached_tokens == 128 * 64
    r = refused(view(replace(slow, prefix=frozenset())), ask)  # 10 s of prefill, cold
    assert r.error.code == "prompt_exceeds_ttft_budget"


def test_a_drifting_engine_scores_worse() -> None:
    v = view(engine("drifting", penalty=1.5), engine("steady", inflight=2))
    assert placed(v, Ask(100, 2.0)).engines == ("steady",)
    assert placed(view(engine("drifting"), engine("steady", inflight=2)), Ask(100, 2.0)).engines == ("drifting",)


def test_learned_output_lengths_size_the_decode_charge() -> None:
    v = view(engine("a"), outputs=(("chat", 0, 40.0), ("completion", 0, 300.0)))
    chat = placed(v, Ask(100, 2.0))
    comp = placed(v, Ask(100, 2.0, kind="completion"))
    capped = placed(v, Ask(100, 2.0, kind="completion", max_output_tokens=100))  # bucket 7: the prior, capped
    assert chat.expected_out == 40 and comp.expected_out == 300 and capped.expected_out == 100
    assert charge(comp)["a"].decode_tokens == 300
    exact = placed(v, Ask(100, 2.0, max_output_tokens=500, min_output_tokens=500))  # ignore_eos
    assert exact.expected_out == 500 and charge(exact)["a"].decode_tokens == 500


def test_slot_wait_follows_the_decode_ledger() -> None:
    full = dict(inflight=10, slots=8)  # three requests (this one included) wait for a slot
    short = placed(view(engine("a", decode_tokens=10 * 5.0, **full)), Ask(100, 30.0))
    long = placed(view(engine("a", decode_tokens=10 * 500.0, **full)), Ask(100, 30.0))
    tpot_full = 0.02 + 0.004 * 8
    assert short.slot_wait_s == pytest.approx(3 * (0.02 + 5 * tpot_full) / 8)
    assert long.slot_wait_s == pytest.approx(3 * (0.02 + 500 * tpot_full) / 8)
    r = refused(view(engine("a", decode_tokens=10 * 500.0, **full)), Ask(100, 2.0))
    assert r.error.code == "ttft_budget_exceeded"


async def test_scheduler_decode_ledger_is_corrected_as_tokens_arrive_and_ends_at_zero() -> None:
    svc, clock = scheduler_service({"mode": "predictive"})
    u = svc.engines["u"]
    res = await svc.admit(AdmitRequest("t1", clock.t + 60, 10, 1000, 2.0, kind="completion"))
    assert res.error is None
    decode = res.candidates[0].decode.name
    d = svc.engines[decode]
    assert d.decode_tokens == pytest.approx(128.0)  # the prior: nothing learned yet
    svc.report(Report(progress={"t1": 100}))
    assert d.decode_tokens == pytest.approx(28.0)
    svc.report(Report(progress={"t1": 200}))  # outgrew its expectation
    assert d.decode_tokens == pytest.approx(50.0)
    route = res.candidates[0]
    svc.report(Report(released=[("t1", RelayStats(route.kind, route.engines, 0.05, 230, 2.3, 1), True)]))
    assert all(e.decode_tokens == 0 for e in svc.engines.values()) and u.inflight == 0
    # what it generated is what the next completion of that size is expected to generate
    res = await svc.admit(AdmitRequest("t2", clock.t + 60, 10, 1000, 2.0, kind="completion"))
    assert svc.engines[res.candidates[0].decode.name].decode_tokens == pytest.approx(230.0)
    assert svc.snapshot()["output_lengths"] == [{"route": "completion", "max_tokens_bucket": 10, "mean_tokens": 230.0}]
    svc.report(Report(released=[("t2", None, False)]))
    assert all(e.decode_tokens == 0 for e in svc.engines.values())


# -- Retry-After a client can trust: room kept for retries (admission/retry.py) -------------------

def busy(**kw: Any) -> EngineFacts:
    """One engine whose projection for a 100-token prompt is 1.5 s (budget 2 s): 1.5 = 0.02 + 0.0002·x."""
    return engine("e", pending_prefill_tokens=7300, **kw)


def test_a_ttft_refusal_reserves_room_for_a_client_that_retries() -> None:
    v = view(engine("e", pending_prefill_tokens=20_000))  # 4 s projected
    plain = refused(v, Ask(100, 2.0))
    assert plain.error.code == "ttft_budget_exceeded" and plain.reserve is None  # not a retrying client
    r = refused(v, Ask(100, 2.0, reserves=True))
    assert r.reserve is not None and r.error.retry_after is not None
    assert (r.reserve.engine, r.reserve.tokens) == ("e", 100)
    assert r.reserve.due == NOW + r.error.retry_after and r.reserve.until > r.reserve.due


def test_reservations_never_book_more_than_half_a_budget_of_prefill() -> None:
    from narwhal_serve.admission.retry import Reservation

    v = lambda *held: view(engine("e", pending_prefill_tokens=20_000), reservations=held)  # noqa: E731
    one = Reservation("r1", "e", NOW + 0.5, NOW + 10.0, 3000)  # 0.62 s of prefill, live when a new one falls due
    r = refused(v(one), Ask(100, 2.0, reserves=True))
    assert r.reserve is not None  # 0.02 + 0.0002 · 3,100 = 0.64 s booked: within 1 s (half the budget)
    two = Reservation("r2", "e", NOW + 0.7, NOW + 10.0, 3000)
    r = refused(v(one, two), Ask(100, 2.0, reserves=True))
    # booked up (1.24 s): the refusal is as honest, but keeps no room, so refusals cannot snowball
    assert r.reserve is None and r.error.code == "ttft_budget_exceeded" and r.error.retry_after is not None
    # reservations due after this one's due time, or dropped by then, do not count
    late = Reservation("r3", "e", NOW + 60.0, NOW + 62.0, 3000)
    dropped = Reservation("r4", "e", NOW - 3.0, NOW + 0.5, 3000)
    assert refused(v(one, late, dropped), Ask(100, 2.0, reserves=True)).reserve is not None


def test_reserved_room_is_taken_by_retries_not_by_new_requests() -> None:
    from narwhal_serve.admission.retry import Reservation

    due_soon = Reservation("r1", "e", NOW + 0.5, NOW + 2.5, 3000)  # 0.6 s of prefill, due within the budget
    v = view(busy(), reservations=(due_soon,))
    assert placed(view(busy()), Ask(100, 2.0)).engines == ("e",)  # without it: 1.5 s, admitted
    assert refused(v, Ask(100, 2.0)).error.code == "ttft_budget_exceeded"  # 2.1 s with the room kept
    assert placed(v, Ask(100, 2.0, retry=True)).engines == ("e",)  # a retry may use it
    later = Reservation("r2", "e", NOW + 5.0, NOW + 7.0, 3000)  # due after this one's first token
    gone = Reservation("r3", "e", NOW - 3.0, NOW - 1.0, 3000)  # its client never came back
    assert placed(view(busy(), reservations=(later, gone)), Ask(100, 2.0)).engines == ("e",)


async def test_holders_keep_reservations_and_retries_take_them() -> None:
    from narwhal_serve.admission.lease import AdmissionLease

    svc, clock = scheduler_service({"mode": "predictive", "ttft_budget_s": 2.0})
    for e in svc.engines.values():
        e.pending_prefill_tokens = 20_000  # every route projected over 4 s
    svc.views_stale()  # (the test sets the engines' state itself, untouched)
    res = await svc.admit(AdmitRequest("s1", clock.t + 60, 100, 16, 2.0, reserves=True))
    assert res.error is not None and res.error.code == "ttft_budget_exceeded"
    assert list(svc.reservations) == ["s1"]
    # an ingress lease: its own refusal reserves too, and its report hands the reservation over
    lease = AdmissionLease("i1")
    lease.apply(svc.report(Report(lease=lease.cut(0.0))), clock.t, 0.0)  # type: ignore[arg-type]
    refusal = lease.try_admit("l1", Ask(100, 2.0, reserves=True), clock.t + 60, clock.t, 0.0)
    assert isinstance(refusal, Refusal) and refusal.reserve is not None and refusal.reserve.id == "l1"
    view_now = lease.current_view()
    assert view_now is not None and {r.id for r in view_now.reservations} == {"s1", "l1"}
    lease.apply(svc.report(Report(lease=lease.cut(0.0))), clock.t, 0.0)  # type: ignore[arg-type]
    assert set(svc.reservations) == {"s1", "l1"}
    # the load drains; a retry through the lease takes the earliest reservation
    for e in svc.engines.values():
        e.pending_prefill_tokens = 0
    svc.views_stale()  # (the test sets the engines' state itself, untouched)
    lease.apply(svc.report(Report(lease=lease.cut(0.0))), clock.t, 0.0)  # type: ignore[arg-type]
    got = lease.try_admit("l2", Ask(100, 2.0, retry=True, reserves=True), clock.t + 60, clock.t, 0.0)
    assert isinstance(got, Placement)
    view_now = lease.current_view()
    assert view_now is not None and {r.id for r in view_now.reservations} == {"l1"}
    lease.apply(svc.report(Report(lease=lease.cut(0.0))), clock.t, 0.0)  # type: ignore[arg-type]
    assert set(svc.reservations) == {"l1"}
    # a retry through the scheduler takes the other; unclaimed ones are dropped after their grace
    res = await svc.admit(AdmitRequest("s2", clock.t + 60, 100, 16, 2.0, retry=True, reserves=True))
    assert res.error is None and not svc.reservations
    await svc.admit(AdmitRequest("s3", clock.t + 60, 100, 16, 2.0, reserves=True))  # admitted: nothing kept
    assert not svc.reservations


def test_projections_are_judged_with_the_engines_prediction_margin() -> None:
    from narwhal_serve.prediction.ttft import ErrorWindow

    w = ErrorWindow(quantile=0.9)
    for i in range(96):  # measured up to 40 % over the prediction, uniformly
        w.observe(1.0 * (1 + 0.4 * i / 95), 1.0)
    # the errors' 90th percentile (0.36), blended with the prior (0.25) as 16 errors would weigh
    assert w.margin == pytest.approx((96 * 0.36 + 16 * 0.25) / 112, abs=0.01)
    # past the first 32 errors the margin is recomputed every 8th (prediction/ttft.py refit_due)
    later = ErrorWindow(quantile=0.9, errors=type(w.errors)(w.errors, maxlen=w.errors.maxlen), margin=w.margin)
    for _ in range(7):
        later.observe(3.0, 1.0)
    assert later.margin == w.margin
    later.observe(3.0, 1.0)
    assert later.margin > w.margin
    assert ErrorWindow().margin == 0.25  # before any error is known
    quiet = ErrorWindow()
    for _ in range(200):
        quiet.observe(0.03, 0.01)  # a fast request's jitter: relative to the 0.25 s floor, small
    assert quiet.margin < 0.1
    assert placed(view(busy()), Ask(100, 2.0)).predicted_s == pytest.approx(1.5, rel=0.01)
    r = refused(view(busy(ttft_margin=w.margin)), Ask(100, 2.0))  # 1.5 s · 1.345 = 2.02 s
    assert r.error.code == "ttft_budget_exceeded" and r.error.retry_after == 1
    assert placed(view(busy(ttft_margin=w.margin)), Ask(100, 2.1)).predicted_s == pytest.approx(1.5, rel=0.01)


def test_reserved_requests_hold_sequence_slots_too() -> None:
    from narwhal_serve.admission.retry import Reservation

    full = engine("e", inflight=8, slots=8)  # every slot taken: one more waits for one to free
    alone = placed(view(full), Ask(100, 30.0))
    held = Reservation("r", "e", NOW + 0.5, NOW + 2.5, 10)
    # judged as if the retry were in line before it (twice the wait: 1.71 s, 2.14 s with the margin)
    assert placed(view(full), Ask(100, 1.5)).predicted_s == pytest.approx(alone.predicted_s)
    assert refused(view(full, reservations=(held,)), Ask(100, 1.5)).error.code == "ttft_budget_exceeded"
    # but predicted as it will be served: the retry comes after it, so its own wait is unchanged
    with_room = placed(view(full, reservations=(held,)), Ask(100, 30.0))
    assert (with_room.slot_wait_s, with_room.predicted_s) == pytest.approx((alone.slot_wait_s, alone.predicted_s))
    assert placed(view(full, reservations=(held,)), Ask(100, 1.5, retry=True)).slot_wait_s == pytest.approx(
        alone.slot_wait_s)  # a retry takes the room: not judged against it


async def test_a_pending_prefix_places_the_next_request_behind_it_and_the_index_learns_it_at_first_token() -> None:
    from narwhal_serve.admission.lease import AdmissionLease

    svc, clock = scheduler_service({"mode": "predictive"})
    hashes = text_block_hashes("s" * 2048, 256, 128)
    ask = Ask(600, 2.0, prefix=hashes, prefix_block_tokens=64.0)
    lease = AdmissionLease("i1")
    lease.apply(svc.report(Report(lease=lease.cut(0.0))), clock.t, 0.0)  # type: ignore[arg-type]
    p = lease.try_admit("a", ask, clock.t + 60, clock.t, 0.0)
    assert isinstance(p, Placement) and p.cached_tokens == 0
    # still prefilling: the next request with its prefix queues behind it on the same engine and is
    # credited the blocks it will find cached when its own prefill starts (not spilled cold)
    again = lease.try_admit("b", ask, clock.t + 60, clock.t, 0.0)
    assert isinstance(again, Placement) and again.engines == p.engines and again.matched_tokens == len(hashes) * 64
    holder = svc.engines[p.first_engine or ""]
    part = lease.cut(0.0)
    svc.report(Report(lease=part))
    assert len(holder.prefix) == 0 and holder.prefix.pending == len(hashes)  # the scheduler's view: pending
    assert set(hashes) <= set(svc.view(clock.t).engines[[e.cfg.name for e in svc.view(clock.t).engines].index(holder.cfg.name)].prefix)
    svc.report(Report(lease=lease.cut(0.0), decode_started=[("a", p.engines), ("b", p.engines)]))
    assert len(holder.prefix) == len(hashes) and holder.prefix.pending == 0  # learned once the first token is reported


def test_a_cold_engine_is_ranked_like_the_best_measured_one_not_by_its_prior() -> None:
    warm = engine("warm", inflight=1, tpot_a=0.004, tpot_b=0.001)
    cold = engine("cold", tpot_known=False, ttft_margin=0.25)  # the 20 ms TPOT prior, no errors known
    # ranked by its prior (20 ms/token) it would never get the traffic that would measure it
    assert placed(view(warm, cold), Ask(100, 2.0)).engines == ("cold",)
    assert placed(view(replace(warm, inflight=0), replace(cold, inflight=1)), Ask(100, 2.0)).engines == ("warm",)


async def test_a_resume_moves_a_lease_ticket_to_the_engine_it_resumed_on() -> None:
    from narwhal_serve.admission.lease import AdmissionLease

    svc, clock = scheduler_service({"mode": "open"})
    lease = AdmissionLease("i1")
    lease.apply(svc.report(Report(lease=lease.cut(0.0))), clock.t, 0.0)  # type: ignore[arg-type]
    p = lease.try_admit("a", Ask(100, 2.0), clock.t + 60, clock.t, 0.0)
    assert isinstance(p, Placement)
    lease.first_token("a", p.engines)
    other = next(n for n in svc.engines if n not in p.engines)
    lease.first_token("a", (other,))  # the relay resumed the answer there
    local = lease._deltas  # the lease's own view of its charges, until the next report
    assert local[other].inflight == 1 and all(local[n].inflight == 0 for n in p.engines)
    svc.report(Report(lease=lease.cut(0.0), decode_started=[("a", p.engines), ("a", (other,))]))
    assert svc.engines[other].inflight == 1 and all(svc.engines[n].inflight == 0 for n in p.engines)
    lease.release("a", 5)
    svc.report(Report(lease=lease.cut(0.0), released=[("a", None, True)]))
    assert all(e.inflight == 0 for e in svc.engines.values())
    assert lease.tickets == {} and not any(vars(lease.in_use).values())


def test_an_idle_engine_with_its_margin_at_the_cap_refuses_for_good_what_it_never_admits() -> None:
    """(Found by a hostile probe.) The margin is added to the prompt alone as to the projection."""
    e = engine("u", ttft_a=0.02, ttft_b=0.002, ttft_margin=1.0)
    out = refused(view(e), Ask(300, 1.0, exact=True))  # 0.62 s alone, 1.24 s judged
    assert out.error.code == "prompt_exceeds_ttft_budget" and out.error.retry_after is None
    assert placed(view(replace(e, ttft_margin=0.25)), Ask(300, 1.0, exact=True)).engines == ("u",)


def test_a_tenant_over_its_share_is_told_to_retry_not_to_shorten_a_prompt_its_target_holds() -> None:
    e = engine("u", ttft_a=0.05, ttft_b=0.002, ttft_margin=0.0)  # 0.85 s alone
    v = view(e, over_share=frozenset({"a"}))
    out = refused(v, Ask(400, 1.0, tenant="a", exact=True))  # over 75 % of its target, within it
    assert out.error.code == "ttft_budget_exceeded" and out.error.retry_after == 1
    assert placed(v, Ask(400, 1.0, tenant="b", exact=True)).engines == ("u",)
