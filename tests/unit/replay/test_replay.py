"""``narwhal-bench replay``: a trace through the real scheduler, leases and admission on a virtual
clock.  Every request ends exactly once and nothing is left held; overload is refused with a
Retry-After that retries use; shared prefixes reach the router's index through the engines' own KV
events and land where they are cached; prefill/decode fleets serve through both legs; a run is
deterministic; and the planner picks the smallest fleet that meets its target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal_serve.bench import replay as bench_replay
from narwhal_serve.bench.cli import main as bench_main
from narwhal_serve.bench.stats import Slo
from narwhal_serve.admission.counters import unbalanced
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.replay.run import REPLAY_ENGINE, FleetSpec, Replay, ReplayOptions, Served
from narwhal_serve.replay.trace import TraceRequest, load, write
from narwhal_serve.replay.vloop import run_virtual

ENGINE = REPLAY_ENGINE.model_copy(update={"prefill_per_token_s": 0.0002, "tpot_base_s": 0.01,
                                          "tpot_per_running_s": 0.001, "max_num_seqs": 16})


def _trace(n: int, rate: float, prompt: int = 600, out: int = 40, shared: int = 0) -> list[TraceRequest]:
    """``n`` requests at ``rate``/s; with ``shared`` groups, each prompt starts with one of them (2 blocks)."""
    return [TraceRequest(i / rate, prompt + (i * 37) % 300, out + (i * 13) % 60,
                         blocks=(1000 + (i % shared), 2000 + (i % shared)) if shared else ()) for i in range(n)]


def _run(trace: list[TraceRequest], fleet: FleetSpec, **opts: object) -> tuple[list[Served], Replay]:
    rp = Replay(NarwhalConfig(), fleet, ReplayOptions(**opts))  # type: ignore[arg-type]
    return run_virtual(rp.run(trace)), rp


def _settled(rp: Replay) -> None:
    snap = rp.snapshot
    assert unbalanced(snap["counters"]) == 0, snap["counters"]
    assert not any(snap["gauges"].values()), snap["gauges"]  # no permit, queue slot or lease use left
    for e in snap["engines"]:
        assert e["inflight"] == 0 and e["pending_prefill_tokens"] == 0, e
    for e in rp.engines.values():
        assert e.slots.running == 0 and not e.slots.queue


def test_light_load_serves_everything_within_the_target() -> None:
    served, rp = _run(_trace(200, 5.0), FleetSpec(unified=2, engine=ENGINE))
    assert len(served) == 200 and all(s.ok and s.status == 200 for s in served)
    assert all(s.ttft is not None and s.ttft < 2.0 for s in served)
    assert all(s.output_tokens == t.output_tokens for s, t in zip(served, _trace(200, 5.0)))
    assert all(s.predicted_ttft is not None for s in served)  # every admission was judged on a projection
    assert {n for s in served for n in s.engines} == {"unified-0", "unified-1"}
    assert rp.snapshot["counters"]["completed"] == 200
    _settled(rp)
    assert 0 < rp.virtual_s < 60


def test_overload_is_refused_with_retry_after_and_retries_come_back() -> None:
    served, rp = _run(_trace(600, 60.0, prompt=1500, out=120), FleetSpec(unified=1, engine=ENGINE))
    first = [s for s in served if s.retry_of is None]
    retries = [s for s in served if s.retry_of is not None]
    refused = [s for s in first if s.status == 429]
    assert len(first) == 600 and refused and retries
    assert all(s.retry_after is not None and s.retry_after >= 1 for s in refused if s.error_code == "ttft_budget_exceeded")
    assert len(retries) == sum(1 for s in refused if s.retry_after is not None)
    by_idx = {s.idx: s for s in first}
    assert all(r.sent >= by_idx[r.retry_of].sent + (by_idx[r.retry_of].retry_after or 0) - 1e-6
               for r in retries if r.retry_of is not None)
    admitted = [s for s in served if s.status == 200]
    assert all(s.ok for s in admitted)
    ttfts = sorted(s.ttft for s in admitted if s.ttft is not None)
    assert ttfts[len(ttfts) // 2] < 2.0  # what is admitted mostly meets its target
    _settled(rp)


def test_shared_prefixes_are_placed_where_the_kv_events_say_they_are() -> None:
    trace = _trace(300, 8.0, prompt=1100, shared=3)
    served, rp = _run(trace, FleetSpec(unified=3, engine=ENGINE))
    assert all(s.ok for s in served)
    by_group: dict[int, set[str]] = {}
    for s, t in zip(sorted(served, key=lambda s: s.idx), trace):
        by_group.setdefault(t.blocks[0], set()).update(s.engines)
    hits = sum(e.cache.hits for e in rp.engines.values())
    assert hits > 0
    # a group's prefix stays mostly on one engine: far fewer engines per group than a blind spread
    assert sum(len(v) for v in by_group.values()) < 3 * len(by_group)
    _settled(rp)


def test_a_prefill_decode_fleet_serves_through_both_legs() -> None:
    served, rp = _run(_trace(120, 5.0), FleetSpec(prefill=1, decode=1, unified=0, engine=ENGINE))
    assert all(s.ok and s.engines == ("prefill-0", "decode-0") for s in served)
    p, d = rp.engines["prefill-0"].counters, rp.engines["decode-0"].counters
    assert p.generation_tokens == 120  # one token per prefill leg
    assert d.generation_tokens == sum(t.output_tokens for t in _trace(120, 5.0))
    _settled(rp)


def test_a_replay_is_deterministic() -> None:
    trace = _trace(150, 30.0, prompt=1200)
    a, _ = _run(trace, FleetSpec(unified=1, engine=ENGINE))
    b, _ = _run(trace, FleetSpec(unified=1, engine=ENGINE))
    assert [(s.idx, s.status, s.ttft, s.e2e, s.retry_of) for s in a] == \
        [(s.idx, s.status, s.ttft, s.e2e, s.retry_of) for s in b]


def test_own_jsonl_round_trips_and_the_shipped_traces_load(tmp_path: Path) -> None:
    trace = [TraceRequest(0.5, 700, 30, (4, 5), 512, "acme", "batch"), TraceRequest(0.1, 90, 3)]
    path = tmp_path / "t.jsonl"
    write(path, trace)
    assert load(path) == sorted(trace, key=lambda r: r.at_s)
    for name in ("azure", "mooncake"):
        got = load(bench_replay.trace_of(name))
        assert len(got) > 10_000 and got[0].at_s <= got[-1].at_s
    assert any(r.blocks for r in load(bench_replay.trace_of("mooncake"))[:50])


def test_fleet_grid() -> None:
    fleets = bench_replay.fleet_grid("prefill=1..2/decode=1,3", ENGINE)
    assert [f.label for f in fleets] == ["prefill=1,decode=1", "prefill=2,decode=1", "prefill=1,decode=3",
                                         "prefill=2,decode=3"]
    assert [f.label for f in bench_replay.fleet_grid("unified=3,1", ENGINE)] == ["unified=1", "unified=3"]
    with pytest.raises(SystemExit):
        bench_replay.fleet_grid("gpu=2", ENGINE)


def test_the_planner_picks_the_smallest_fleet_that_meets_the_target(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write(trace, _trace(400, 5.0, prompt=1500, out=100))
    engine = tmp_path / "engine.yaml"
    engine.write_text("prefill_per_token_s: 0.0002\ntpot_base_s: 0.01\ntpot_per_running_s: 0.001\nmax_num_seqs: 16\n")
    assert bench_main(["replay", "--trace", str(trace), "--fleet", "unified=1..3", "--sweep", "--engine-config",
                       str(engine), "--out", str(tmp_path / "out")]) == 0
    res = json.loads(next((tmp_path / "out").glob("replay-*/results.json")).read_text())
    rows = res["rows"]
    assert [r["fleet"] for r in rows] == ["unified=1", "unified=2", "unified=3"]
    assert [r["offered"] for r in rows] == [400, 400, 400]
    meets = [r["fleet"] for r in rows if r["meets"]]
    assert meets and res["smallest"]["predictive"] == meets[0]
    assert not rows[0]["meets"]  # one engine prefills about 3 of these a second: not 5
    assert rows[-1]["goodput_rps"] >= rows[0]["goodput_rps"]
    assert res["meta"]["slo"]["ttft_s"] == Slo(2.0, float("inf")).ttft_s


def test_costs_measure_every_part_and_change_nothing() -> None:
    from narwhal_serve.replay.costs import Costs

    trace = _trace(200, 40.0, prompt=1200, shared=2)
    plain, _ = _run(trace, FleetSpec(unified=1, engine=ENGINE))
    costs = Costs()
    rp = Replay(NarwhalConfig(), FleetSpec(unified=1, engine=ENGINE), ReplayOptions(), costs=costs)
    costed = run_virtual(rp.run(trace))
    assert [(s.idx, s.status, s.ttft) for s in costed] == [(s.idx, s.status, s.ttft) for s in plain]
    rows = {r["part"]: r for r in costs.report(len(trace), rp.virtual_s)}
    assert {"ingress.decide", "ingress.grant", "ingress.cut", "scheduler.report", "scheduler.scrape",
            "scheduler.kv_events", "scheduler.periodic"} <= set(rows)
    assert all(r["calls"] > 0 and r["cpu_s"] >= 0 for r in rows.values())
    assert rows["ingress.decide"]["calls"] >= sum(1 for s in costed if s.status == 200) // 2
    assert rows["ingress.decide"]["p50_us"] is not None and rows["ingress.decide"]["p99_us"] >= rows["ingress.decide"]["p50_us"]
    assert rp.kv_blocks > 0


def test_a_collectors_pass_is_its_own_row_not_the_part_it_fell_in() -> None:
    import gc

    from narwhal_serve.replay.costs import GC_PART, Costs

    costs = Costs()
    junk = [[i] for i in range(300_000)]  # a heap worth a pass

    def part(collect: bool) -> None:
        if collect:
            gc.collect()

    timed = costs.timed("part", part)
    with costs.watching_gc():
        timed(True)
    timed(False)  # after the watch: no pass counted
    rows = {r["part"]: r for r in costs.report(1, 1.0)}
    assert rows[GC_PART]["calls"] >= 1 and costs.gc_ns > 0
    # the part's own CPU is what it spent outside the pass (nearly nothing), not the pass's
    assert costs.parts["part"].ns < costs.gc_ns
    assert gc.callbacks.count(costs._on_gc) == 0
    del junk


@pytest.mark.parametrize("hop_s", [0.004, 0.015, 0.03])
def test_a_one_token_answers_end_follows_its_first_token_across_the_hop(hop_s: float) -> None:
    """The first token and the end leave the engine at the same instant for a one-token answer;
    across a hop both are due at the same instant again, and the loop runs such timers in any
    order.  The end must still reach the router after the first token (one stream's messages
    keep their order), or the request never ends and the run never does (it hung at 15 ms)."""
    import threading

    trace = [TraceRequest(i / 20.0, 200 + (i * 37) % 300, 1 + i % 2) for i in range(120)]
    out: list[tuple[list[Served], Replay]] = []
    run = threading.Thread(target=lambda: out.append(_run(trace, FleetSpec(unified=2, engine=ENGINE), hop_s=hop_s)),
                           daemon=True)  # (a run that never ends is a failure here, not a hung suite)
    run.start()
    run.join(60)
    assert out, "the replay never ended: a request's end reached the router before its first token"
    served, rp = out[0]
    done = [s for s in served if s.status == 200]
    assert len(done) > 100 and all(s.ok and s.ttft is not None and s.ttft <= s.e2e for s in done)
    _settled(rp)
