"""SchedulerService without HTTP: engines marked healthy by hand, a virtual clock."""

import asyncio

from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.scheduler.messages import AdmitRequest, Report
from narwhal_serve.scheduler.service import SchedulerService
from tests.support.scheduler import Clock, scheduler_service


def service(mode: str = "open", **adm: object) -> tuple[SchedulerService, Clock]:
    return scheduler_service(
        {"mode": mode, "queue_limit": 2, "max_wait_s": 5, "phase_concurrency": {"prefill": 1, "decode": 4}, **adm}
    )


def req(tid: str, prompt: int = 10, budget: float = 2.0) -> AdmitRequest:
    return AdmitRequest(tid, 2000.0, prompt, 16, budget)


async def test_grant_queue_release_and_counters() -> None:
    svc, _ = service()
    a = await svc.admit(req("a"))
    assert a.error is None and {r.kind for r in a.candidates} == {"single", "pd"}
    waiter = asyncio.ensure_future(svc.admit(req("b")))
    await asyncio.sleep(0)
    assert svc.admission.gauges()["queued"] == 1
    svc.report(Report(decode_started=[("a", ())]))  # a's prefill permit frees: b is granted
    b = await waiter
    assert b.error is None
    svc.report(Report(released=[("a", None, False), ("b", None, False)]))
    assert svc.admission.gauges() == {"retained": 0, "queued": 0, "prefill_inflight": 0, "decode_inflight": 0}
    assert all(e.inflight == 0 and e.pending_prefill_tokens == 0 and e.pending_prefill_requests == 0 for e in svc.engines.values())


async def test_cancel_frees_queue_slots_and_grants() -> None:
    svc, _ = service()
    await svc.admit(req("a"))
    waiter = asyncio.ensure_future(svc.admit(req("b")))
    await asyncio.sleep(0)
    svc.cancel("b")
    res = await waiter
    assert res.error is not None and res.error.code == "cancelled"  # the ingress counts it
    assert svc.admission.gauges()["queued"] == 0
    svc.cancel("never-seen")  # a cancel that overtakes its admit leaves a tombstone
    late = await svc.admit(req("never-seen"))
    assert late.error is not None and late.error.code == "cancelled"
    svc.cancel("a")  # a grant whose answer never reached its client is freed too
    assert svc.admission.gauges() == {"retained": 0, "queued": 0, "prefill_inflight": 0, "decode_inflight": 0}
    assert all(e.inflight == 0 and e.pending_prefill_tokens == 0 and e.pending_prefill_requests == 0 for e in svc.engines.values())


async def test_no_eligible_engine_and_router_states() -> None:
    svc, clock = service()
    clock.t += 10  # every engine's metrics are now stale
    r = await svc.admit(req("x"))
    assert r.error is not None and r.error.code == "backend_unavailable" and r.error.retry_after == 1
    assert svc.readiness() == (False, "no_eligible_engines")
    svc.set_mode("fenced")
    r = await svc.admit(req("y"))
    assert r.error is not None and r.error.code == "router_unavailable" and r.error.reason == "fenced"
    assert svc.readiness() == (False, "fenced")


async def test_predictive_learns_and_refuses_with_pending_work() -> None:
    svc, _ = service("predictive", phase_concurrency={"prefill": 8, "decode": 8})
    # teach every first-token engine: 1 ms per 100 tokens
    for i in range(30):
        tid = f"t{i}"
        res = await svc.admit(req(tid, prompt=100 * (i % 10 + 1), budget=60))
        route = res.candidates[0]
        ttft = 0.002 + 0.00001 * 100 * (i % 10 + 1)
        svc.report(Report(released=[(tid, RelayStats(route.kind, route.engines, ttft, 5, 0.01, 1), True)]))
    big = await svc.admit(req("big", prompt=150_000, budget=60))  # holds ~1.5 s of prefill
    assert big.error is None
    first = big.candidates[0].prefill or big.candidates[0].decode
    # both routes now differ by the pending work: the short request goes to the other route
    other = await svc.admit(req("short", prompt=10, budget=0.5))
    assert other.error is None
    assert (other.candidates[0].prefill or other.candidates[0].decode).name != first.name
    svc.report(Report(released=[("short", None, False)]))
    svc.engines["u" if first.name == "p" else "p"].pending_prefill_tokens = 150_000  # load the other too
    refused = await svc.admit(req("late", prompt=10, budget=0.5))
    assert refused.error is not None and refused.error.code == "ttft_budget_exceeded"
    assert refused.error.retry_after is not None and refused.error.retry_after >= 1
    assert svc.counters.contract_view()["refused"] == 1


async def test_predictive_sees_requests_queueing_for_slots() -> None:
    svc, _ = service("predictive", phase_concurrency={"prefill": 64, "decode": 64})
    for e in svc.engines.values():
        e.cfg = e.cfg.model_copy(update={"max_num_seqs": 2})
        e.service_s = 1.0  # each request holds a slot for about a second
    admitted = 0
    for i in range(12):
        r = await svc.admit(req(f"q{i}", prompt=10, budget=1.0))
        if r.error is None:
            admitted += 1
            svc.report(Report(decode_started=[(f"q{i}", ())]))  # prefill done, still decoding
        else:
            assert r.error.code == "ttft_budget_exceeded"
    # two routes with two slots each, then a wait under 1 s for at most one more per route
    assert 4 <= admitted <= 8
    assert svc.counters.contract_view()["refused"] == 12 - admitted


async def test_failed_attempts_open_a_breaker_a_probe_closes_it() -> None:
    import httpx

    from narwhal_serve.relay.messages import EngineFault

    svc, clock = service()
    boom = EngineFault("u", "error", "HTTP 500")
    svc.report(Report(health=[boom, boom, boom]))  # three in a row (breaker_failures defaults to 3)
    u = svc.engines["u"]
    assert u.breaker.state == "open" and not u.eligible(clock.t, 5.0, frozenset())
    a = await svc.admit(req("a"))
    assert a.error is None and all("u" not in r.engines for r in a.candidates)
    assert svc.snapshot()["engines"][0]["breaker"] == "open"
    assert 'narwhal_engine_breaker_open{engine="u"} 1' in svc.metrics_text()
    assert 'narwhal_engine_attempt_faults_total{engine="u",kind="error"} 3' in svc.metrics_text()
    opened_at = clock.t
    assert svc.view(clock.t).tripped == (("u", opened_at),)  # ingresses resume the streams still on u

    answers = [httpx.Response(500), httpx.Response(200, json={"choices": [{"text": "x", "token_ids": [7]}]})]
    bodies: list[bytes] = []

    def engine(r: httpx.Request) -> httpx.Response:
        bodies.append(r.content)
        return answers.pop(0)

    svc._client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    svc.start_probes()
    assert not svc.prober.tasks  # not before the open period is over
    clock.t += 2.0
    svc.start_probes()
    await asyncio.gather(*svc.prober.tasks)
    assert u.breaker.state == "open" and u.breaker.open_s == 4.0  # the probe failed: open again, longer
    assert svc.view(clock.t).tripped == (("u", opened_at),)  # (no client work went there since: no new trip)
    clock.t += 4.0
    svc.start_probes()
    await asyncio.gather(*svc.prober.tasks)
    u.last_ok = clock.t  # (metrics fresh on the virtual clock)
    assert u.breaker.state == "closed" and u.eligible(clock.t, 5.0, frozenset())
    assert svc.view(clock.t).tripped == ()
    assert b'"max_tokens": 1' in bodies[0].replace(b":1", b": 1") and b"return_token_ids" in bodies[0]
    await svc._client.aclose()


async def test_backpressure_keeps_an_engine_out_briefly_and_a_first_token_resets_failures() -> None:
    from narwhal_serve.relay.messages import EngineFault, EngineWorked

    svc, clock = service()
    svc.report(Report(health=[EngineFault("u", "backpressure", "HTTP 429", 2.0)]))
    u = svc.engines["u"]
    assert not u.eligible(clock.t, 5.0, frozenset()) and u.breaker.failures == 0
    clock.t += 2.0
    assert u.eligible(clock.t, 5.0, frozenset())
    svc.report(Report(health=[EngineFault("u", "timeout")]))
    a = await svc.admit(req("a"))
    assert a.error is None
    svc.report(Report(decode_started=[("a", ("u",))], health=[EngineWorked(("u",))]))
    assert u.breaker.failures == 0


def test_breaker_counts_failures_in_the_order_they_happened() -> None:
    """One report may carry an answer's first token and its mid-stream fault: a first token between
    two faults breaks the run of failures, so the breaker (3 in a row) stays closed."""
    from narwhal_serve.relay.messages import EngineFault, EngineWorked

    svc, _ = service()
    u = svc.engines["u"]
    cut, ok = EngineFault("u", "error", "stream reset"), EngineWorked(("u",))
    svc.report(Report(health=[ok, cut, ok, cut, ok, cut]))
    assert u.breaker.state == "closed" and u.breaker.failures == 1
    svc.report(Report(health=[cut, cut]))
    assert u.breaker.state == "open"


async def test_monitoring_degraded_is_detected_and_recovers_by_itself() -> None:
    svc, clock = service()

    def pass_ends() -> None:  # what a monitor pass ends with (SchedulerService.scrape_once)
        svc.ha.last_pass = clock.t
        svc.views_stale()

    pass_ends()
    assert svc.readiness() == (True, "active")
    clock.t += 6  # no engine answered for longer than stale_after_s: the router's view is dark
    pass_ends()
    assert svc.readiness() == (False, "monitoring_degraded")
    r = await svc.admit(req("x"))
    assert r.error is not None and r.error.code == "router_unavailable" and r.error.reason == "monitoring_degraded"
    assert "fresh data from 0 of 3" in str(svc.snapshot()["ha"]["monitoring_degraded"])
    for e in svc.engines.values():  # they answer again: refused connections are a definite "down"
        e.last_answer = clock.t
    assert svc.readiness() == (False, "monitoring_degraded")  # until the pass that saw it ends
    pass_ends()
    assert svc.readiness() == (False, "no_eligible_engines")  # down, not dark: backend_unavailable
    r = await svc.admit(req("y"))
    assert r.error is not None and r.error.code == "backend_unavailable"
    for e in svc.engines.values():
        e.last_ok = clock.t
    pass_ends()
    assert svc.readiness() == (True, "active")
    r = await svc.admit(req("z"))  # what /ready said is what the requests after it get
    assert r.error is None
    clock.t += 3.5  # the monitor loop has not completed a pass for max(3 × 1 s, 5 s)... not yet
    assert svc.readiness() == (True, "active")
    for e in svc.engines.values():
        e.last_ok = clock.t
    clock.t += 2
    assert svc.readiness() == (False, "monitoring_degraded") and "stalled" in str(svc.ha.degraded_why)
    pass_ends()
    assert svc.readiness() == (True, "active")


async def test_maintenance_drains_and_the_lease_decides_the_mode() -> None:
    svc, clock = service()
    a = await svc.admit(req("a"))
    assert a.error is None
    served = a.candidates[0].engines
    waves = svc.maintenance(["a"], True)  # every engine is in wave a
    assert waves == ["a"] and svc.readiness() == (False, "maintenance")
    views = {e["name"]: e for e in svc.snapshot()["engines"]}
    assert all(views[n]["draining"] for n in served) and all(v["maintenance"] for v in views.values())
    svc.report(Report(released=[("a", None, True)]))
    assert not any(e["draining"] for e in svc.snapshot()["engines"])
    svc.maintenance(["a"], False)
    assert svc.readiness() == (True, "active")



async def test_failures_never_open_more_breakers_than_the_fleet_can_spare() -> None:
    from narwhal_serve.relay.messages import EngineFault

    svc, _ = service()
    svc.report(Report(health=[EngineFault(n, "error") for n in ("u", "p", "d") for _ in range(3)]))
    states = {n: e.breaker.state for n, e in svc.engines.items()}
    assert states == {"u": "open", "p": "closed", "d": "closed"}  # 3 engines: at most one open
    assert svc.engines["p"].breaker.failures == 3  # counted: it opens as soon as it may



async def test_backpressure_never_takes_more_of_the_fleet_out_than_it_can_spare() -> None:
    from narwhal_serve.relay.messages import EngineFault

    svc, clock = service()
    svc.report(Report(health=[EngineFault(n, "backpressure", "HTTP 429", 5.0) for n in ("u", "p", "d")]))
    out = [n for n, e in svc.engines.items() if not e.breaker.takes_work(clock.t)]
    assert out == ["u"]  # 3 engines: one out at a time; the others keep taking work


async def test_a_resume_moves_the_ticket_to_the_engine_it_resumed_on_and_counts_the_cut() -> None:
    from narwhal_serve.admission.counters import CounterDelta

    svc, _ = service()
    a = await svc.admit(req("a"))
    route = a.candidates[0]
    svc.report(Report(decode_started=[("a", route.engines)]))
    other = next(n for n in svc.engines if n not in route.engines)
    assert all(svc.engines[n].inflight == 1 for n in route.engines) and svc.engines[other].inflight == 0
    cut = CounterDelta()
    cut.resumes[("reset", "resumed")] += 1
    svc.report(Report(decode_started=[("a", (other,))], counters=cut))  # the relay resumed it on `other`
    assert svc.engines[other].inflight == 1 and all(svc.engines[n].inflight == 0 for n in route.engines)
    assert svc.admission.gauges()["decode_inflight"] == 1
    svc.report(Report(released=[("a", RelayStats("single", (other,), 0.01, 5, 0.02, 1, (route.engines[-1],), (0.004,)), True)]))
    assert all(e.inflight == 0 and e.decode_tokens == 0 for e in svc.engines.values())
    assert svc.admission.gauges() == {"retained": 0, "queued": 0, "prefill_inflight": 0, "decode_inflight": 0}
    text = svc.metrics_text()
    assert 'narwhal_resumes_total{reason="reset",outcome="resumed"} 1' in text
    assert 'narwhal_resumes_total{reason="stall",outcome="not_exact"} 0' in text  # every pair from the start
    assert "narwhal_resume_gap_seconds_count 1" in text


async def test_an_engine_followed_by_its_kv_events_keeps_a_hit_prefix_in_the_leases_view() -> None:
    """A request's first token from the engine it was placed on marks the prompt's blocks that the
    engine's events said it holds as just used: the prefix stays in the view a lease is granted
    (its most recent blocks) while more newer blocks than that view carries are stored after it."""
    svc, clock = scheduler_service({"mode": "predictive"}, placement={"prefix_view_blocks": 64})
    for e in svc.engines.values():
        e.prefix_exact = True
    u = svc.engines["u"]
    shared = (11, 12, 13, 14)
    u.prefix.insert(list(shared))
    for i in range(4):
        got = await svc.admit(AdmitRequest(f"t{i}", 2000.0, 600, 16, 2.0, prefix=shared + (50 + i,),
                                           prefix_block_tokens=64.0))
        placement = svc._tickets[f"t{i}"].placement
        assert got.error is None and placement.first_engine == "u"  # (the holder of its prefix)
        svc.report(Report(decode_started=[(f"t{i}", placement.engines)]))
        u.prefix.insert(list(range(1000 + 40 * i, 1040 + 40 * i)))  # others' prompts stored since (160 in all)
        svc.touch("u")  # (as the engine's events do)
        clock.t += 0.1
        held = svc.view(clock.t, frozen=True).facts()["u"].prefix
        assert set(shared) <= held and 50 + i not in held  # (used, not stored: the events never named it)
        svc.report(Report(released=[(f"t{i}", None, False)]))


async def test_a_queued_request_that_waited_out_its_budget_is_refused_when_its_turn_comes() -> None:
    """A request queued for a permit is decided again when it is granted, against its budget less
    its whole wait since it reached the router (the ingress's part and the queue's): a hostile probe
    saw 66 of a 200-stream burst granted from the queue after waiting over their 2 s budget."""
    svc, clock = service("predictive")
    a = await svc.admit(req("a"))
    assert a.error is None
    on_time = asyncio.ensure_future(svc.admit(AdmitRequest("b", 2000.0, 10, 16, 2.0, waited_s=0.2)))
    late = asyncio.ensure_future(svc.admit(AdmitRequest("c", 2000.0, 10, 16, 2.0, waited_s=0.2)))
    await asyncio.sleep(0)
    assert svc.admission.gauges()["queued"] == 2
    for e in svc.engines.values():
        e.last_ok = clock.t + 1.0
    clock.t += 1.0  # b: 1.2 s of its 2 s gone
    svc.report(Report(decode_started=[("a", ())]))  # a's prefill permit frees: b is granted
    b = await on_time
    assert b.error is None, b.error
    for e in svc.engines.values():
        e.last_ok = clock.t + 1.0
    clock.t += 1.0  # c: 2.2 s gone
    svc.report(Report(decode_started=[("b", ())]))
    c = await late
    assert c.error is not None and c.error.code == "ttft_budget_exceeded", c
    assert "less the 2.20 s it has waited" in c.error.message and c.error.retry_after == 1
    svc.report(Report(released=[("a", None, False), ("b", None, False)]))
    assert svc.admission.gauges() == {"retained": 0, "queued": 0, "prefill_inflight": 0, "decode_inflight": 0}
    assert svc.counters.contract_view()["refused"] == 1
