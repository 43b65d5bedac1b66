"""The decode-side models on constructed data (prediction/decode.py), the prefix index
(placement/prefix.py) and the drift state (placement/drift.py)."""

from __future__ import annotations

import random

import pytest

from narwhal_serve.config import PlacementConfig
from narwhal_serve.placement.drift import REL_CAP, Drift, ProfileErrors, rel_error
from narwhal_serve.placement.prefix import (
    PrefixIndex,
    id_block_hashes,
    matched_blocks,
    request_prefix,
    text_block_hashes,
)
from narwhal_serve.prediction.decode import (
    DEFAULT_OUTPUT_PRIOR,
    MAX_BUCKET,
    OutputLengths,
    TpotModel,
    bucket,
    expected_output,
    remaining_tokens,
)


def test_tpot_model_learns_growth_with_batch() -> None:
    m = TpotModel()
    rng = random.Random(1)
    for _ in range(200):
        batch = rng.randint(1, 8)
        m.observe(batch, 0.025 + 0.002 * batch + rng.gauss(0, 0.0005))
    assert m.predict(1) == pytest.approx(0.027, rel=0.05)
    assert m.predict(8) == pytest.approx(0.041, rel=0.05)


def test_tpot_model_prior_holds_without_spread() -> None:
    m = TpotModel()
    assert m.predict(4) == pytest.approx(0.02)  # the prior: no data, no batch dependence
    for _ in range(20):
        m.observe(4, 0.05)  # one batch size only: the level moves, the slope stays near the prior
    assert m.predict(4) == pytest.approx(0.05, rel=0.1)
    assert m.b < 0.005


def test_output_lengths_learn_per_kind_and_bucket() -> None:
    o = OutputLengths()
    for n in (90, 110, 100):
        o.observe("chat", 500, n)
    for n in (10, 12):
        o.observe("completion", 500, n)
    table = o.table()
    assert expected_output(table, "chat", 300) == pytest.approx(100, rel=0.01)  # same bucket (256..511)
    assert expected_output(table, "chat", 600) == pytest.approx(DEFAULT_OUTPUT_PRIOR)  # unseen bucket: prior
    assert expected_output(table, "completion", 400) == pytest.approx(11, rel=0.01)
    assert expected_output(table, "chat", 260) == pytest.approx(100, rel=0.01)
    assert expected_output(table, "chat", 64) == pytest.approx(64)  # unseen bucket, prior capped at max_tokens
    assert expected_output((), "chat", None) == DEFAULT_OUTPUT_PRIOR


def test_expected_output_counts_what_the_answer_writes_at_least() -> None:
    """ignore_eos (vLLM's benchmark) writes all of max_tokens; min_tokens is a floor; the learned
    mean of a bucket stands where it lies between them."""
    o = OutputLengths()
    for _ in range(20):
        o.observe("chat", 300, 100)
    table = o.table()
    assert expected_output(table, "chat", 300, least=300) == 300  # ignore_eos: exactly max_tokens
    assert expected_output(table, "chat", 300, least=150) == 150  # min_tokens above the mean
    assert expected_output(table, "chat", 300, least=50) == pytest.approx(100, rel=0.01)  # below: the mean
    assert expected_output((), "chat", None, least=2000) == 2000  # no max_tokens: the floor still holds


def test_output_lengths_are_bounded() -> None:
    o = OutputLengths()
    for mt in [None, *range(1, 1 << 20, 997), 1 << 40]:
        o.observe("chat", mt, 3)
        o.observe("completion", mt, 3)
    assert len(o.means) <= 2 * (MAX_BUCKET + 1)
    assert bucket(None) == 0 and bucket(1) == 1 and bucket(1 << 40) == MAX_BUCKET


def test_output_mean_forgets_slowly() -> None:
    o = OutputLengths()
    for _ in range(200):
        o.observe("chat", None, 10)
    for _ in range(60):
        o.observe("chat", None, 200)  # the workload changed: the mean follows
    assert expected_output(o.table(), "chat", None) > 150


def test_remaining_tokens_correction() -> None:
    assert remaining_tokens(100, 0, None) == 100
    assert remaining_tokens(100, 40, None) == 60
    assert remaining_tokens(100, 160, None) == 40  # outgrew its expectation: a quarter of what it made
    assert remaining_tokens(100, 160, 170) == 10  # never past max_tokens
    assert remaining_tokens(100, 170, 170) == 0


def test_block_hashes_share_exact_prefixes() -> None:
    a = text_block_hashes("x" * 64 * 5 + "tail-a", 64, 100)
    b = text_block_hashes("x" * 64 * 5 + "other-tail", 64, 100)
    c = text_block_hashes("y" + "x" * 64 * 5, 64, 100)
    assert a == b and len(a) == 5
    assert not set(a) & set(c)  # chained: a different first block changes every hash
    assert text_block_hashes("z" * 1000, 64, 3) == text_block_hashes("z" * 1000, 64, 100)[:3]
    assert id_block_hashes(list(range(40)), 16, 10) == id_block_hashes(list(range(32)) + [7] * 8, 16, 10)
    assert len(id_block_hashes(list(range(40)), 16, 10)) == 2


def test_request_prefix_reads_messages_with_roles() -> None:
    sys_prompt = "You are a helpful assistant. " * 40
    one, per = request_prefix("chat", {"messages": [{"role": "system", "content": sys_prompt},
                                                    {"role": "user", "content": "hi"}]}, None, 64, 16, 100)
    two, _ = request_prefix("chat", {"messages": [{"role": "system", "content": sys_prompt},
                                                  {"role": "user", "content": "bye, and more"}]}, None, 64, 16, 100)
    as_user, _ = request_prefix("chat", {"messages": [{"role": "user", "content": sys_prompt}]}, None, 64, 16, 100)
    assert per == 16.0 and len(one) >= 10 and one[:10] == two[:10]
    assert one[0] != as_user[0]  # the role is part of the prefix
    parts, _ = request_prefix("chat", {"messages": [{"role": "system", "content": [{"type": "text", "text": sys_prompt}]}]},
                              None, 64, 16, 100)
    assert parts[:5] == one[:5]
    ids, per_ids = request_prefix("completion", {"prompt": [1, 2]}, list(range(100)), 64, 16, 100)
    assert per_ids == 16.0 and len(ids) == 6
    assert request_prefix("completion", {"prompt": 5}, None, 64, 16, 100) == ((), 0.0)


def test_prefix_index_is_bounded_lru() -> None:
    idx = PrefixIndex(capacity=8)
    old = text_block_hashes("a" * 64 * 6, 64, 100)
    new = text_block_hashes("b" * 64 * 6, 64, 100)
    idx.insert(old)
    assert matched_blocks(idx.held(), old) == 6
    idx.insert(new)
    assert len(idx) == 8  # the least recently placed blocks went first
    assert matched_blocks(idx.held(), new) == 6
    assert matched_blocks(idx.held(), old) == 0  # its first blocks were evicted: no prefix match
    assert idx.frozen(3) <= set(new) and len(idx.frozen(3)) == 3  # the most recent, for ingress views
    assert PrefixIndex(0).frozen(10) == frozenset()


def test_relative_errors_have_a_floor_and_a_cap() -> None:
    assert rel_error(0.02, 0.002, 0.25) == pytest.approx(0.072)  # timer noise on a fast engine
    assert rel_error(3.0, 0.5, 0.25) == REL_CAP  # one outlier counts as at most REL_CAP
    assert rel_error(0.0, 0.5, 0.25) == -1.0


def test_drift_penalty_out_and_back() -> None:
    cfg = PlacementConfig(drift_penalty_at=0.25, drift_out_at=1.0, drift_back_at=0.3, drift_probes=3, drift_probe_s=1.0)
    d = Drift()
    for t in range(3):
        d.observe_ttft(0.0, float(t))
    assert d.penalty(cfg) == 0 and not d.should_go_out(cfg) and not d.profile_due(10.0, cfg)
    d.observe_ttft(REL_CAP, 10.0)
    d.observe_ttft(REL_CAP, 10.0)  # two measurements 3x slower than modelled
    assert 0 < d.penalty(cfg) and not d.should_go_out(cfg)
    # penalized and then taught nothing (placement avoids it): profiled, so evidence keeps coming
    assert not d.profile_due(10.5, cfg) and d.profile_due(11.0, cfg)
    d.profile_sent(11.0, cfg)
    assert not d.profile_due(11.5, cfg)  # one profile in flight at a time
    assert not d.on_profile(True, ProfileErrors(REL_CAP, REL_CAP), 12.0, cfg)  # counts like a request
    assert not d.profile_due(12.5, cfg) and d.profile_due(13.0, cfg)
    assert not d.should_go_out(cfg)  # three TTFT errors at the cap in a row: 0.98
    d.observe_ttft(REL_CAP, 13.0)
    assert d.should_go_out(cfg)  # four: out
    d.go_out(20.0, "slow")
    assert d.out and d.penalty(cfg) == 0 and d.profile_due(20.0, cfg) and not d.should_go_out(cfg)
    d.profile_sent(20.0, cfg)
    assert not d.profile_due(20.5, cfg)
    assert not d.on_profile(True, ProfileErrors(), 21.0, cfg)  # nothing to predict from yet
    assert not d.on_profile(True, ProfileErrors(0.1), 22.0, cfg)
    assert not d.on_profile(True, ProfileErrors(0.6), 23.0, cfg)  # off its re-measured model: start over
    assert not d.on_profile(False, ProfileErrors(), 24.0, cfg)  # a failed (or bad-ID) profile never counts
    assert not d.on_profile(True, ProfileErrors(0.1, -0.2), 25.0, cfg)
    assert not d.on_profile(True, ProfileErrors(0.05), 26.0, cfg)
    assert d.on_profile(True, ProfileErrors(None, 0.2), 27.0, cfg)  # three in a row: back, scores reset
    assert not d.out and d.score == 0 and d.outs == 1


def test_the_index_never_remembers_more_than_the_engines_kv_cache() -> None:
    from narwhal_serve.engines.metrics import parse_engine_metrics
    from narwhal_serve.placement.prefix import index_capacity

    text = ('vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="950"} 1.0\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n')
    load = parse_engine_metrics(text)
    assert load.kv_tokens == 15_200 and load.running == 2
    assert parse_engine_metrics('vllm:cache_config_info{engine="0"} 1.0\n').kv_tokens == 0
    assert index_capacity(4096, load.kv_tokens, 64.0) == int(15_200 * 0.8 / 64)
    assert index_capacity(4096, 0, 64.0) == 4096  # not reported: the configured cap
    idx = PrefixIndex(10)
    idx.insert(text_block_hashes("q" * 64 * 10, 64, 100))
    idx.resize(4)
    assert len(idx) == 4 and idx.capacity == 4


def test_a_credited_prefix_is_learned_as_a_hit_or_a_miss() -> None:
    from narwhal_serve.admission.core import Placement
    from narwhal_serve.config import EngineConfig
    from narwhal_serve.placement.engines import EngineState
    from narwhal_serve.protocol.placement import RouteChoice
    from narwhal_serve.protocol.stats import RelayStats
    from narwhal_serve.scheduler.learning import learn_from
    from narwhal_serve.telemetry import Histogram

    cfg = EngineConfig(name="e", url="http://127.0.0.1:9", role="unified")
    e = EngineState(cfg)
    e.ttft_model.a, e.ttft_model.b = 0.02, 0.0003  # 3,000 uncached tokens: 0.92 s; 32: 0.03 s
    route = RouteChoice(kind="single", decode=cfg)
    p = Placement((route,), "e", 3032, 32, 0.0, 0.03, cached_tokens=3000, matched_tokens=3000)
    hists = {k: Histogram() for k in ("ttft", "tpot", "ttft_prediction_error", "ttft_predicted")}
    credit = e.prefix_credit
    learn_from(RelayStats("single", ("e",), 0.95, 1, 0.0, 1), p, {"e": e}, hists)  # the engine had evicted it
    assert e.prefix_credit < credit and e.ttft_model.samples[-1][0] == 3032  # learned at its full prefill
    credit = e.prefix_credit
    learn_from(RelayStats("single", ("e",), 0.04, 1, 0.0, 1), p, {"e": e}, hists)
    assert e.prefix_credit > credit and e.ttft_model.samples[-1][0] == 32


def test_an_engine_out_for_drift_is_re_measured_by_its_profiles_alone() -> None:
    """An engine taken out for drift starts its models again, and only its profiles teach them: its
    requests placed before it went out and finishing since (slow: the slowness that took it out)
    do not, so a few profiles that match it bring it back (taught to the new model, a burst of
    them kept a healthy engine out for minutes)."""
    from narwhal_serve.admission.core import Placement
    from narwhal_serve.config import EngineConfig, NarwhalConfig
    from narwhal_serve.scheduler.monitor import Profile
    from narwhal_serve.placement.engines import EngineState
    from narwhal_serve.protocol.placement import RouteChoice
    from narwhal_serve.protocol.stats import RelayStats
    from narwhal_serve.scheduler.health import profile_errors, update_drift
    from narwhal_serve.scheduler.learning import learn_from
    from narwhal_serve.telemetry import Histogram

    cfg = NarwhalConfig.model_validate({"engines": [{"name": n, "url": f"http://127.0.0.1:{i + 1}"}
                                                    for i, n in enumerate("ef")]})
    engines = {c.name: EngineState(c) for c in cfg.engines}
    for x in engines.values():
        x.healthy = True  # (both up: one of two may go out)
    e = engines["e"]
    hists = {k: Histogram() for k in ("ttft", "tpot", "ttft_prediction_error", "ttft_predicted")}
    route = RouteChoice(kind="single", decode=e.cfg)
    p = Placement((route,), "e", 1000, 1000, 0.0, 0.05, predicted_tpot_s=0.01, decode_engine="e", batch=1.0)
    for _ in range(6):  # a burst's requests come 30x slower than predicted: out
        learn_from(RelayStats("single", ("e",), 1.5, 20, 6.0, 1), p, engines, hists, placement=cfg.placement)
    assert update_drift(engines, 10.0, cfg) == ["e"] and e.drift.out and not e.ttft_model.samples
    for _ in range(26):  # more of them finish while it is out
        learn_from(RelayStats("single", ("e",), 1.5, 20, 6.0, 1), p, engines, hists, placement=cfg.placement)
    assert not e.ttft_model.samples and not e.tpot_model.samples
    for i in range(8):  # profiles answering as fast as ever (the first measures, the next match)
        prof = Profile(ok=True, ttft_s=0.03, tpot_s=0.005, prompt_tokens=250)
        if e.drift.on_profile(True, profile_errors(e, prof, cfg), 11.0 + i, cfg.placement):
            break
    assert not e.drift.out
