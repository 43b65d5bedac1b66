"""Breakers, drift and the learned prefix index, from a review (each test failed before its fix).

Pure and in-process: no Ray, no servers, no engines (virtual time)."""

from __future__ import annotations

import asyncio

from narwhal_serve.config import MonitoringConfig, NarwhalConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.drift import Drift
from narwhal_serve.placement.health import Breaker
from narwhal_serve.relay.messages import EngineFault
from narwhal_serve.scheduler.health import apply_health


def _cfg(n: int, **over: object) -> NarwhalConfig:
    return NarwhalConfig.model_validate(
        {"engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(n)], **over})


def _engines(cfg: NarwhalConfig):  # the scheduler's own starting fleet
    from narwhal_serve.scheduler.state import initial_engines
    return initial_engines(cfg)


def test_breaker_of_an_engine_down_for_a_day_still_reopens_and_probes() -> None:
    # placement/health.py Breaker._open: ``cfg.breaker_open_s * (2 ** self.opened)`` with
    # ``opened`` growing by one per failed probe and never reset while the engine stays broken.
    # At the 1024th reopen (about 17 h of failed probes at breaker_max_open_s = 60 s) int -> float
    # raises OverflowError inside Breaker.on_probe, after probe_due already set the state to
    # "probing": Prober._probe's task dies, probe_due only fires from "open", so the engine is never
    # probed again and takes no work for the life of the scheduler, even after it is repaired.
    # Correct (docs/contract.md "Engine failures": "a bad one opens it again for twice as long
    # (at most breaker_max_open_s)"): reopen for breaker_max_open_s, and keep probing.
    cfg = MonitoringConfig()
    b = Breaker()
    now = 0.0
    for _ in range(cfg.breaker_failures):
        b.on_fault("error", now, cfg)
    assert b.state == "open"
    for _ in range(1100):
        now = b.open_until
        assert b.probe_due(now)
        b.on_probe(False, now, cfg, "probe failed: ConnectError")
        assert b.state == "open"
    assert b.open_s == cfg.breaker_max_open_s


def test_an_engine_already_pushing_back_is_not_counted_against_its_own_breaker() -> None:
    # scheduler/health.py apply_health: ``spare = may_open(_out_of_work(engines, now), ...)``
    # counts the failing engine itself when it is already out of work (a backpressure window).
    # Two engines (cap: one out): e0 answered 503 (out for its Retry-After), then fails
    # breaker_failures times. Opening e0's breaker takes nothing more out of the fleet (e0 is the
    # one engine out either way, e1 still serves), yet it is refused as if a second engine went
    # out. The breaker stays closed, the "tripped" list misses e0 (streams on it are not resumed),
    # and when the window ends clients are placed on a broken engine again.
    # Correct (docs/contract.md: "engines out of work for either reason never exceed
    # breaker_max_open_fraction of the fleet"): count the others, not the engine deciding.
    # (update_drift has the same self-count for an engine out for backpressure.)
    cfg = _cfg(2, monitoring={"breaker_failures": 2})
    engines = _engines(cfg)
    now = 100.0
    for e in engines.values():  # both up
        e.healthy, e.last_ok = True, now
    events = [EngineFault("e0", "backpressure", "HTTP 503", 5.0),
              EngineFault("e0", "error", "HTTP 500"), EngineFault("e0", "error", "HTTP 500")]
    tripped = apply_health(engines, events, now, cfg)
    assert engines["e1"].breaker.takes_work(now)
    assert engines["e0"].breaker.state == "open" and tripped == ["e0"]


def test_breakers_never_take_out_the_last_engines_that_are_up() -> None:
    # scheduler/health.py _out_of_work / may_open: the cap is a fraction of len(engines), all
    # configured engines, and only breaker/backpressure/drift outs count as out. With two of four
    # engines down (their scrapes fail: healthy False), the cap (2) still lets both engines that are
    # up open their breakers, e.g. on a prompt that makes every engine answer 500 (retried across
    # routes): nothing is left to serve, every request gets 503 backend_unavailable.
    # Correct (docs/contract.md "Engine failures": "never all of it: failures the router cannot tell
    # apart from one request's own trouble (a prompt the engine chokes on) must not take the whole
    # fleet out"; "Drift": "never the last engine"): engines already unable to serve (down,
    # maintenance) count as out, or the cap is taken over the engines that can serve.
    cfg = _cfg(4, monitoring={"breaker_failures": 2})
    engines = _engines(cfg)
    now = 100.0
    for name in ("e0", "e3"):
        engines[name].healthy, engines[name].last_ok = True, now
    for name in ("e1", "e2"):  # down: refused connections at their scrapes
        engines[name].healthy, engines[name].last_answer = False, now
    assert sum(e.eligible(now, cfg.monitoring.stale_after_s, frozenset()) for e in engines.values()) == 2
    events = [EngineFault(n, "error", "HTTP 500") for n in ("e0", "e3", "e0", "e3")]
    apply_health(engines, events, now, cfg)
    assert any(e.eligible(now, cfg.monitoring.stale_after_s, frozenset()) for e in engines.values())


def test_learned_prefix_index_never_remembers_more_than_the_kv_cache_with_token_blocks() -> None:
    # scheduler/service.py scrape_once sizes a learned index with
    # ``index_capacity(..., kv_tokens, prefix_block_chars / CHARS_PER_TOKEN)``: blocks of 64 tokens
    # by default. But where the router has a tokenizer every prompt is hashed in blocks of
    # ``prefix_block_tokens`` tokens (gateway/completion.py _ask -> request_prefix). With
    # prefix_block_tokens 256, an engine caching 16,000 tokens gets an index of 200 blocks =
    # 51,200 tokens: three times its cache, so evicted prefixes are credited as cached (lower TTFT
    # projections, placements chasing prefixes the engine no longer holds).
    # Correct (docs/contract.md "Admission", prefix-aware placement: "An engine's learned index never remembers
    # more than its KV cache holds (80 % of block_size x num_gpu_blocks)"): 16,000 x 0.8 / 256 = 50.
    from narwhal_serve.scheduler.service import SchedulerService

    cfg = _cfg(1, tokenizer="narwhal-sim", placement={"prefix_block_tokens": 256})
    svc = SchedulerService(cfg, clock=lambda: 100.0)

    async def no_scrape() -> None:
        svc.engines["e0"].load = EngineLoad(0.0, 0.0, 0.0, 16_000)

    svc.scrape_engines = no_scrape  # type: ignore[method-assign]
    asyncio.run(svc.scrape_once())
    assert svc.engines["e0"].prefix.capacity == int(16_000 * 0.8 / 256)


def test_an_engine_going_out_for_drift_gets_no_second_profile_while_one_is_in_flight() -> None:
    # placement/drift.py Drift.go_out sets ``next_profile = now`` unconditionally. A penalized,
    # idle engine gets an in-rotation profile (profile_sent: next_profile = inf "until its answer");
    # if update_drift takes it out before that answer, profile_due is True at once and Profiler
    # starts a second profile beside the first, against "at most one in flight per engine"
    # (scheduler/health.py Profiler). The two prefill together, so each measures the other's load
    # as the engine's own slowness (the re-measurement that decides when it comes back).
    # Correct: go_out keeps a profile in flight (next_profile stays inf until on_profile re-arms it).
    from narwhal_serve.config import PlacementConfig
    pl = PlacementConfig()
    d = Drift(ttft=pl.drift_penalty_at + 0.1, last_sample=0.0)
    assert d.profile_due(10.0, pl)
    d.profile_sent(10.0, pl)  # in flight now
    d.ttft = pl.drift_out_at + 0.5  # requests finishing meanwhile push it past drift_out_at
    d.go_out(10.2, "drift")
    assert not d.profile_due(10.2, pl)


def test_a_probe_or_profile_that_raises_counts_as_failed_and_the_next_one_still_comes(monkeypatch) -> None:
    # scheduler/health.py Prober._probe / Profiler._profile: a probe that raised left its breaker
    # "probing" for good (probe_due fires only from "open"), a profile that raised left the engine's
    # next profile at infinity (out for drift for good). Correct: counted as a failed one.
    from narwhal_serve.scheduler import health

    async def boom(*a: object, **k: object) -> object:
        raise RuntimeError("odd engine answer")

    monkeypatch.setattr(health, "probe_one", boom)
    monkeypatch.setattr(health, "profile_one", boom)
    cfg = _cfg(2, monitoring={"breaker_failures": 1}, admission={"mode": "predictive"})
    engines = _engines(cfg)
    e = engines["e0"]
    now = [100.0]
    e.breaker.on_fault("error", now[0], cfg.monitoring)
    e.drift.go_out(now[0], "drift")

    async def run() -> None:
        prober = health.Prober(cfg, lambda: now[0], lambda: None)
        profiler = health.Profiler(cfg, lambda: now[0], lambda: None)
        now[0] = e.breaker.open_until
        prober.start_due([e], None)  # type: ignore[arg-type]
        profiler.start_due([e], None)  # type: ignore[arg-type]
        await asyncio.gather(*prober.tasks, *profiler.tasks)

    asyncio.run(run())
    assert e.breaker.state == "open" and e.breaker.probes_total == {"failed": 1}
    assert e.drift.next_profile < float("inf") and "RuntimeError" in (e.drift.last_reason or "")


def test_one_engine_page_the_router_cannot_read_costs_that_engine_not_the_pass(monkeypatch) -> None:
    # scheduler/monitor.py scrape_all: a fault reading one engine's answers (here a cache-config line
    # whose num_gpu_blocks is past a float's range: OverflowError, not ValueError) escaped the whole
    # pass — every engine's pass, each time, so the monitoring loop never completed one and the router
    # went monitoring-degraded. Correct: that page is read as odd (ignored), and a fault in reading
    # any one engine is that engine's failed scrape (down), the others scraped as usual.
    import httpx

    from narwhal_serve.engines.metrics import parse_engine_metrics
    from narwhal_serve.scheduler import monitor

    huge = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1' + "0" * 400 + '"} 1.0\n'
    assert parse_engine_metrics(huge).kv_tokens == 0

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_running 1\n")
        return httpx.Response(200, json={})

    cfg = _cfg(2)
    engines = _engines(cfg)
    real = monitor.scraped

    def scraped(e, now, healthy, metrics):  # a reading fault on e1's answers alone
        if e.cfg.name == "e1":
            raise RuntimeError("unreadable")
        real(e, now, healthy, metrics)

    monkeypatch.setattr(monitor, "scraped", scraped)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await monitor.scrape_all(client, list(engines.values()), 100.0, 1.0)

    asyncio.run(run())
    assert engines["e0"].healthy and engines["e0"].load.running == 1
    assert not engines["e1"].healthy and engines["e1"].last_answer == 100.0


def test_a_managed_engines_new_process_starts_with_an_empty_learned_prefix_index() -> None:
    # scheduler/managed.py _take reset a new process's breaker and load but kept its learned prefix
    # index (an engine without KV events): the old process's cache, credited to the new one until
    # the measured hit rate decayed. Correct: a new process holds no blocks; those of requests
    # placed there still pending stay pending (their prefills end, or fail, as before).
    from narwhal_serve.managed.slot import ReplicaReport
    from narwhal_serve.scheduler.service import SchedulerService

    cfg = NarwhalConfig.model_validate({"engines": [{"name": "m", "role": "unified", "launch": {"kind": "sim"}}]})
    svc = SchedulerService(cfg, clock=lambda: 100.0)

    def report(replica: str, port: int) -> ReplicaReport:
        return ReplicaReport(engine="m", replica=replica, url=f"http://10.0.0.1:{port}", node_id="n",
                             node_ip="10.0.0.1", accelerator_ids=("0",), pid=port, log="", ready_s=1.0)

    svc.managed.register(report("r1", 8001), 100.0)
    e = svc.engines["m"]
    e.prefix.insert((1, 2, 3))
    e.prefix.pend((4,))
    svc.managed.register(report("r1", 8001), 101.0)  # its heartbeat: the same process
    assert e.prefix.stored(1)
    svc.managed.down("m", "r1", "exit 137", 101.5)
    svc.managed.register(report("r2", 8002), 102.0)  # its new process, in the same slot
    assert svc.engines["m"] is e and e.cfg.url == "http://10.0.0.1:8002"
    assert not any(e.prefix.stored(h) for h in (1, 2, 3)) and e.prefix.pending == 1
