"""The admission issue's measures in ``narwhal-bench goodput``: the shared-prefix workload, retries
admitted after Retry-After, the TTFT prediction error, the TPOT header, the prefix-blind target and
the prefix gain (pure parts, plus the client against a tiny in-process server)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from narwhal_serve.bench.cli import build_parser, goodput_args
from narwhal_serve.bench.client import Endpoint, RetryPolicy, Shape, make_session, run_open_loop
from narwhal_serve.bench.fleet import NARWHAL_PREFIX, SimTiming, narwhal_serve_config, prom_value
from narwhal_serve.bench.goodput import (
    CHAT_LEAD_TOKENS,
    CHAT_TEMPLATE_TOKENS,
    cached_prefix_tokens,
    engine_delta,
    goodput_checks,
    model_capacity,
    oracle_prefix_hit_rate,
    prefix_checks,
    prefix_gain,
    sim_cache_blocks,
)
from narwhal_serve.bench.stats import RequestResult, Slo, summarize, ttft_prediction_error
from narwhal_serve.bench.views import goodput_view
from narwhal_serve.bench.workload import LengthDist, Workload
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.sim.textgen import encode_prompt, render_chat
from narwhal_serve.sim.timing import block_hashes

SLO = Slo(ttft_s=0.5, tpot_s=0.05)
OUT = LengthDist(24, 0.6, 2, 128)


def shared(seed: int = 0, groups: int = 4, prefix: int = 200, suffix: int = 32) -> Workload:
    return Workload(LengthDist(suffix, 0.0, suffix, suffix), OUT, seed=seed, prefix_groups=groups,
                    prefix_tokens=prefix)


# ---- the shared-prefix workload ------------------------------------------------------------------


def test_groups_share_exact_prefixes_and_differ_in_suffix() -> None:
    specs = shared().specs([0.1 * i for i in range(200)])
    by_group: dict[int, list[str]] = {}
    for s in specs:
        assert s.group is not None and 0 <= s.group < 4
        assert s.prompt_tokens == 232 and len(s.prompt.split()) == 232
        by_group.setdefault(s.group, []).append(s.prompt)
    assert sorted(by_group) == [0, 1, 2, 3]  # 200 uniform draws hit every group
    prefixes = {}
    for g, prompts in by_group.items():
        heads = {" ".join(p.split()[:200]) for p in prompts}
        assert len(heads) == 1  # one exact prefix per group
        prefixes[g] = heads.pop()
        tails = [" ".join(p.split()[200:]) for p in prompts]
        assert len(set(tails)) == len(tails)  # every suffix its own
    assert len(set(prefixes.values())) == 4
    assert len({p.split()[0] for p in prefixes.values()}) == 4  # groups differ from their first word (block)
    assert len({s.prompt for s in specs}) == len(specs)


def test_shared_prefix_is_deterministic_by_seed_and_fresh_in_every_phase() -> None:
    times = [0.0] * 50
    a, b = shared(seed=3).specs(times, seed_offset=5), shared(seed=3).specs(times, seed_offset=5)
    assert a == b
    heads = lambda specs: {" ".join(s.prompt.split()[:200]) for s in specs}  # noqa: E731
    # another phase (seed offset) has prefixes of its own: the engines' caches are emptied between
    # phases, and a router must not meet prefixes it placed in the last phase (it would credit them)
    c = shared(seed=3).specs(times, seed_offset=6)
    assert len(heads(c)) == len(heads(a)) == 4 and heads(c).isdisjoint(heads(a))
    assert heads(shared(seed=4).specs(times, seed_offset=5)).isdisjoint(heads(a))


def test_shared_prefix_blocks_hit_the_simulators_prefix_cache() -> None:
    x, y = [s for s in shared(prefix=200).specs([0.0] * 40) if s.group == 0][:2]
    hx = block_hashes(render_chat([("user", x.prompt)]), 16)
    hy = block_hashes(render_chat([("user", y.prompt)]), 16)
    common = next(i for i, (p, q) in enumerate(zip(hx, hy)) if p != q)
    assert common == (4 + 200) // 16 == cached_prefix_tokens(shared(prefix=200)) // 16
    for api, ids in (("chat", render_chat([("user", x.prompt)])), ("completions", encode_prompt(x.prompt))):
        lead = ids.index(encode_prompt(x.prompt)[1])  # where the message starts
        extra = CHAT_TEMPLATE_TOKENS if api == "chat" else 1
        assert (len(ids), lead) == (x.prompt_tokens + extra, CHAT_LEAD_TOKENS if api == "chat" else 1)
    long = [s for s in shared(prefix=1500).specs([0.0] * 40) if s.group == 0][:2]
    hx, hy = (block_hashes(render_chat([("user", s.prompt)]), 16) for s in long)
    common = next(i for i, (p, q) in enumerate(zip(hx, hy)) if p != q)
    assert common * 16 == cached_prefix_tokens(shared(prefix=1500)) == 1504


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_oracle_hit_rate_of_a_shared_prefix_run_is_what_an_unbounded_engine_cache_hits(api: str) -> None:
    """Computed independently: every request's prompt as the simulator tokenizes it, its leading
    block hashes looked up in one unbounded cache of every block seen before."""
    wl = shared(groups=5, prefix=200, suffix=40)
    specs = wl.specs([0.0] * 30, seed_offset=3)
    seen: set[int] = set()
    hit = total = 0
    for s in specs:
        ids = render_chat([("user", s.prompt)]) if api == "chat" else encode_prompt(s.prompt)
        total += len(ids)
        hs = block_hashes(ids, 16)
        hit += 16 * next((i for i, h in enumerate(hs) if h not in seen), len(hs))
        seen.update(hs)
    assert hit > 0 and oracle_prefix_hit_rate(wl, specs, 3, api) == pytest.approx(hit / total)  # type: ignore[arg-type]
    assert oracle_prefix_hit_rate(Workload(LengthDist(16, 0.0, 16, 16), OUT), specs, 3) is None
    assert oracle_prefix_hit_rate(wl, [], 3) is None


def test_prefix_checks_at_overload_only() -> None:
    gain = [{"workload": "shared-prefix", "load": 1.0, "gain": 1.1, "hits_vs_oracle": 0.5},
            {"workload": "shared-prefix", "load": 2.0, "gain": 2.5, "hits_vs_oracle": 0.89},
            {"workload": "mooncake", "load": 2.0, "gain": 1.9, "hits_vs_oracle": None}]
    assert [(c["check"], c["verdict"]) for c in prefix_checks(gain)] == [
        ("shared-prefix: predictive goodput / prefix-blind at 2.0x", "PASS"),
        ("shared-prefix: predictive cache hits / oracle at 2.0x", "MISS"),
        ("mooncake: predictive goodput / prefix-blind at 2.0x", "MISS"),
        ("mooncake: predictive cache hits / oracle at 2.0x", "n/a")]


def test_default_workload_unchanged_and_bad_prefix_rejected() -> None:
    wl = Workload(LengthDist(16, 0.0, 16, 16), OUT, seed=1)
    assert wl.kind == "lognormal" and all(s.group is None for s in wl.specs([0.0] * 3))
    assert shared().kind == "shared-prefix" and shared().mean_prompt_tokens() == 232
    with pytest.raises(ValueError):
        Workload(LengthDist(16, 0.0, 16, 16), OUT, prefix_groups=4, prefix_tokens=0)


def test_capacity_model_and_cache_size_for_shared_prefix() -> None:
    t = SimTiming(prefill_overhead_s=0.0, prefill_per_token_s=0.001, tpot_base_s=0.0, tpot_per_running_s=0.0,
                  max_num_seqs=2)
    wl = shared(groups=8, prefix=1500, suffix=32)
    cold, hot = model_capacity(t, 1, wl), model_capacity(t, 1, wl, cached_tokens=cached_prefix_tokens(wl))
    # (no decode time: the one prefill at a time bounds it, not the two slots)
    # (the simulator's chat template: 11 tokens, 4 of them before the message)
    assert cold == pytest.approx(1 / (0.001 * (1532 + 11)))
    assert hot == pytest.approx(1 / (0.001 * (1532 + 11 - 1504)))
    slots_bound = SimTiming(prefill_overhead_s=0.0, prefill_per_token_s=0.001, tpot_base_s=0.1, tpot_per_running_s=0.0,
                            max_num_seqs=2)
    assert model_capacity(slots_bound, 1, wl) == pytest.approx(2 / (0.001 * 1543 + 0.1 * (wl.output_len.mean() - 1)))
    blocks_per_prompt = -(-1543 // 16)
    assert sim_cache_blocks(wl, 2) == 5 * blocks_per_prompt  # 4 of the 8 prefixes per engine, plus one
    assert sim_cache_blocks(wl, 2) < 8 * 1504 // 16  # not all of them
    assert sim_cache_blocks(Workload(LengthDist(16, 0.0, 16, 16), OUT), 2) == 4096  # the simulator's default


# ---- stats: retries admitted, prediction error, goodput with retries -----------------------------


def ok(idx: int, sent: float, ttft: float, e2e: float, tokens: int = 5, retry_of: int | None = None,
       predicted: float | None = None) -> RequestResult:
    return RequestResult(idx, "t", sent, 10, tokens, status=200, ok=True, ttft=ttft, e2e=e2e, output_tokens=tokens,
                         retry_of=retry_of, predicted_ttft=predicted)


def refused(idx: int, sent: float, retry_of: int | None = None, status: int = 429) -> RequestResult:
    return RequestResult(idx, "t", sent, 10, 5, status=status, error_code="ttft_budget_exceeded", retry_after=1.0,
                         e2e=0.01, retry_of=retry_of)


def test_retries_admitted_count_and_fraction() -> None:
    rs = [refused(i, 0.1 * i) for i in range(5)]
    rs += [ok(0, 1.1, 0.1, 0.2, retry_of=0),  # admitted, good
           ok(1, 1.2, 0.9, 1.0, retry_of=1),  # admitted, misses TTFT
           refused(2, 1.3, retry_of=2),  # refused again (429)
           refused(3, 1.4, retry_of=3, status=503),  # refused again (503)
           RequestResult(4, "t", 1.5, 10, 5, status=0, error_code="cut", retry_of=4)]  # no answer
    ra = summarize(rs, SLO)["retry_after"]
    assert (ra["retry_sample"], ra["retries_admitted"], ra["retries_refused"]) == (5, 2, 2)
    assert ra["retry_success"] == 0.4 and ra["retry_good"] == 0.2
    none = summarize([refused(0, 0.0)], SLO)["retry_after"]
    assert (none["retry_sample"], none["retries_admitted"], none["retry_success"]) == (0, 0, None)


def test_good_retries_count_towards_goodput_not_offered() -> None:
    rs = [ok(0, 0.0, 0.1, 0.3), refused(1, 0.5), ok(1, 1.5, 0.1, 0.3, retry_of=1)]
    s = summarize(rs, SLO, duration_s=2.0)
    assert (s["offered"], s["admitted"], s["refused"], s["good"]) == (2, 1, 1, 1)
    assert s["goodput_rps"] == 1.0 and s["goodput_rps_first_try"] == 0.5
    assert s["slo_attainment_admitted"] == 1.0 and s["refusal_rate"] == 0.5


def test_ttft_prediction_error() -> None:
    rs = [
        ok(0, 0.0, ttft=1.0, e2e=2.0, predicted=0.5),  # |1 - 0.5| / 1 = 0.5, bias -0.5
        ok(1, 0.0, ttft=0.2, e2e=1.0, predicted=0.3),  # 0.5, bias +0.5
        ok(2, 0.0, ttft=0.4, e2e=1.0, predicted=0.4),  # 0
        ok(3, 1.0, ttft=0.5, e2e=1.0, predicted=0.6, retry_of=9),  # retries count: 0.2, bias +0.2
        ok(4, 0.0, ttft=0.5, e2e=1.0),  # no header: not counted
        RequestResult(5, "t", 0.0, 10, 5, status=200, ttft=None, e2e=1.0, predicted_ttft=0.1,
                      error_code="truncated_stream"),  # no first token
        RequestResult(6, "t", 0.0, 10, 5, status=429, e2e=0.01, predicted_ttft=3.0),  # refused
    ]
    p = ttft_prediction_error(rs)
    assert p["n"] == 4
    assert p["err_p50"] == pytest.approx(0.35)  # median of 0, 0.2, 0.5, 0.5
    assert p["bias_p50"] == pytest.approx(0.1)  # median of -0.5, 0, 0.2, 0.5
    assert summarize(rs, SLO)["ttft_prediction"] == p
    assert ttft_prediction_error([ok(0, 0.0, 0.1, 0.2)]) == {"n": 0, "err_p50": None, "err_p90": None,
                                                             "bias_p50": None}


def test_retry_policy_paced_over_the_window() -> None:
    p = RetryPolicy(max_samples=10, probability=1.0)
    assert [p.take(0.05) for _ in range(3)] == [True, False, False]  # ceil(10 * 0.05) = 1 by then
    assert sum(p.take(0.5) for _ in range(10)) == 4
    assert sum(p.take(2.0) for _ in range(10)) == 5 and p.taken == 10


# ---- the client: headers out and in, one retry after Retry-After ---------------------------------


@pytest.fixture
async def router() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """Refuses every first request (429, Retry-After 0.2), admits the rest with a predicted TTFT."""
    seen: list[dict[str, str]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        if len(seen) % 2:
            return web.json_response({"error": {"code": "ttft_budget_exceeded"}}, status=429,
                                     headers={"Retry-After": "0.2"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Narwhal-Predicted-TTFT": "0.125"})
        await resp.prepare(request)
        for text in ("a", "b"):
            await resp.write(b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_client_sends_slo_headers_records_prediction_and_retries(
        router: tuple[str, list[dict[str, str]]]) -> None:
    url, seen = router
    ns = build_parser().parse_args(["goodput", "--slo-ttft-ms", "1500", "--slo-tpot-ms", "40"])
    a = goodput_args(ns)
    shape = Shape(extra_headers=(("X-TTFT-Target", f"{a.slo.ttft_s:g}"), ("X-TPOT-Target", f"{a.slo.tpot_s:g}")))
    specs = Workload(LengthDist(8, 0.0, 8, 8), LengthDist(2, 0.0, 2, 2)).specs([0.0])
    async with make_session() as s:
        rs = await run_open_loop(s, Endpoint("nw", (url,)), shape, specs, drain_s=2.0,
                                 retry=RetryPolicy(a.retry_samples, 1.0))
    assert [(r.retry_of, r.status) for r in rs] == [(None, 429), (0, 200)]
    assert rs[0].retry_after == 0.2 and rs[0].predicted_ttft is None
    assert rs[1].ok and rs[1].predicted_ttft == 0.125 and rs[1].sent >= 0.2
    assert [(h["X-TTFT-Target"], h["X-TPOT-Target"]) for h in seen] == [("1.5", "0.04")] * 2
    assert summarize(rs, a.slo)["retry_after"]["retries_admitted"] == 1


# ---- fleet, checks, prefix gain, CLI and tables -------------------------------------------------


def test_prefix_blind_target_is_predictive_without_prefix_placement() -> None:
    cfg = narwhal_serve_config(8123, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "m",
                               ["narwhal-predictive", "narwhal-prefix-blind"], ttft_budget_s=2.0, max_num_seqs=4)
    apps = {app["name"]: app for app in cfg["applications"]}
    assert apps["narwhal-prefix-blind"]["route_prefix"] == NARWHAL_PREFIX["narwhal-prefix-blind"] == "/prefix-blind"
    blind = NarwhalConfig.model_validate(apps["narwhal-prefix-blind"]["args"])
    aware = NarwhalConfig.model_validate(apps["narwhal-predictive"]["args"])
    assert blind.admission.mode == aware.admission.mode == "predictive"
    assert not blind.placement.prefix_aware and aware.placement.prefix_aware
    assert blind.engines == aware.engines


def row(workload: str, target: str, load: float, goodput: float, refused: float = 0.0) -> dict[str, Any]:
    return {"workload": workload, "target": target, "load": load, "offered_rps": load * 10, "offered": 100,
            "arrived_rps": load * 10, "throughput_rps": goodput, "goodput_rps": goodput,
            "goodput_vs_capacity": goodput / 10, "goodput_rps_span": goodput, "slo_attainment_admitted": 1.0,
            "refusal_rate": refused, "refused": int(refused * 100), "failed": 0,
            "ttft_ms": {"p50": 10.0, "p99": 20.0}, "tpot_ms": {"p99": 30.0}, "itl_ms": {"p99": 30.0},
            "retry_after": {"retry_sample": 4, "retries_admitted": 3, "retry_success": 0.75, "retry_good": 0.5,
                            "not_early": 1.0, "overstatement_median_s": 0.2},
            "ttft_prediction": {"n": 90, "err_p50": 0.12, "err_p90": 0.4, "bias_p50": -0.05}}


def test_checks_at_every_overload_and_prefix_gain(tmp_path: Path) -> None:
    rows = [row("lognormal", "narwhal-predictive", 0.8, 8.0), row("lognormal", "rr", 2.0, 2.0),
            row("lognormal", "narwhal-predictive", 2.0, 9.5, 0.5),
            row("lognormal", "narwhal-predictive", 3.0, 9.0, 0.7),
            row("lognormal", "rr", 3.0, 2.5)]
    names = [c["check"] for c in goodput_checks(rows, 10.0)]
    assert names == ["predictive goodput / capacity at 2.0x", "predictive goodput / rr at 2.0x",
                     "predictive goodput / capacity at 3.0x", "predictive goodput / rr at 3.0x",
                     "predictive admitted within SLO (worst load)", "predictive refused at 0.8x"]
    sp = [row("shared-prefix", "narwhal-predictive", 2.0, 9.0), row("shared-prefix", "narwhal-prefix-blind", 2.0, 7.5),
          row("shared-prefix", "narwhal-prefix-blind", 0.8, 6.0)]
    sp[0]["engines"] = {"requests": [50, 48], "prefix_hit_rate": 0.9}
    sp[1]["engines"] = {"requests": [49, 49], "prefix_hit_rate": 0.4}
    assert prefix_gain(rows + sp) == [{"workload": "shared-prefix", "load": 2.0, "predictive_goodput_rps": 9.0,
                                       "blind_goodput_rps": 7.5, "gain": 1.2, "predictive_engines": sp[0]["engines"],
                                       "blind_engines": sp[1]["engines"], "oracle_hit_rate": None,
                                       "hits_vs_oracle": None}]
    sp[0]["oracle_hit_rate"] = 0.95
    assert prefix_gain(rows + sp)[0]["hits_vs_oracle"] == 0.947
    res = {"capacity": {"workload": "lognormal", "capacity_rps": 10.0},
           "capacities": [{"workload": "lognormal", "capacity_rps": 10.0},
                          {"workload": "shared-prefix", "capacity_rps": 9.0, "model_rps_prefix_cached": 11.0,
                           "prefix_gain_ceiling": 1.16, "sim_cache_blocks": 485}],
           "rows": rows + sp, "prefix_gain": prefix_gain(rows + sp), "checks": goodput_checks(rows, 10.0)}
    text, _ = goodput_view(res, tmp_path)
    assert "shared-prefix: SLO capacity 9.0" in text and "prefix gain ceiling 1.16x" in text
    assert "## prefix gain" in text and "1.200" in text and "0.90 / 0.40" in text and "50,48 / 49,49" in text
    assert "0.95 (pred 0.947x)" in text
    assert "3/4 (0.75)" in text and "retries admitted" in text and "ttft pred err p50" in text


def test_refusal_check_only_near_08() -> None:
    rows = [row("lognormal", "narwhal-predictive", 1.5, 9.0, 0.3)]
    assert [c["check"] for c in goodput_checks(rows, 10.0)] == ["predictive goodput / capacity at 1.5x",
                                                               "predictive admitted within SLO (worst load)"]


def test_engine_delta_and_prometheus_parsing() -> None:
    text = ('# HELP vllm:prefix_cache_hits_total x\nvllm:prefix_cache_hits_total{engine="0"} 320\n'
            'vllm:prefix_cache_hits_total_other 5\nvllm:prefix_cache_queries_total{engine="0"} 1000.0\n')
    assert prom_value(text, "vllm:prefix_cache_hits_total") == 320.0
    assert prom_value(text, "vllm:prefix_cache_queries_total") == 1000.0 and prom_value(text, "nope") == 0.0
    d = engine_delta([(10, 1000, 100), (5, 0, 0)], [(30, 2000, 900), (25, 1000, 0)])
    assert d == {"requests": [20, 20], "prefix_hit_rate": 0.4}
    assert engine_delta([], []) == {"requests": [], "prefix_hit_rate": None}


def test_cli_workloads_and_retry_defaults() -> None:
    ns = build_parser().parse_args(["goodput", "--targets", "narwhal-predictive,narwhal-prefix-blind",
                                    "--workload", "shared-prefix,lognormal,shared-prefix", "--prefix-groups", "6",
                                    "--prefix-tokens", "1000", "--suffix-tokens", "20"])
    assert ns.targets == ["narwhal-predictive", "narwhal-prefix-blind"]
    assert ns.workload == ["shared-prefix", "lognormal"]
    a = goodput_args(ns)
    assert (a.workload.kind, a.workload.prefix_groups, a.workload.prefix_tokens) == ("shared-prefix", 6, 1000)
    assert a.workload.mean_prompt_tokens() == 1020
    assert goodput_args(ns, "lognormal").workload.kind == "lognormal"
    assert (a.retry_samples, a.retry_probability, a.num_gpu_blocks) == (1000, 0.2, None)
    assert build_parser().parse_args(["goodput"]).workload == ["lognormal"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["goodput", "--workload", "nope"])


def test_a_run_with_invalid_requests_says_so() -> None:
    from narwhal_serve.bench.views import invalid_warnings

    rows = [{"target": "direct", "load": 2.0, "offered": 972, "status_counts": {"200": 580, "400": 392}},
            {"target": "narwhal-predictive", "load": 2.0, "offered": 972, "status_counts": {"200": 300, "429": 672}}]
    lines = invalid_warnings(rows)
    assert len(lines) == 1 and "392 of 972 requests to direct at 2.0x" in lines[0] and "context" in lines[0]
