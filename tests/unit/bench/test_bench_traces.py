"""Real-trace and mixed-script workloads of narwhal-bench goodput: the shipped traces load, prompts
sharing Mooncake hash ids share their text (so an engine's prefix cache sees the sharing), arrivals
keep the trace's pattern scaled to the rate, and the oracle hit rate is computed from the trace."""

from __future__ import annotations

from pathlib import Path

from narwhal_serve.bench.workload import LengthDist, Workload, oracle_hit_rate
from narwhal_serve.replay.trace import TRACE_BLOCK_TOKENS, TraceRecord, load_trace
from narwhal_serve.sim.textgen import encode_prompt
from narwhal_serve.tokenization import estimate_tokens

TRACES = Path(__file__).resolve().parents[3] / "narwhal_serve" / "bench" / "traces"
DIST = LengthDist(100, 0.5, 8, 1000)


def test_the_shipped_traces_load() -> None:
    mooncake = load_trace(TRACES / "mooncake-fast25-conversation.jsonl.gz")
    azure = load_trace(TRACES / "azure-llm-2023-conv.csv.gz")
    assert len(mooncake) == 12_031 and len(azure) == 19_366
    assert mooncake[0].hash_ids and not azure[0].hash_ids
    assert all(a.at_s <= b.at_s for a, b in zip(azure, azure[1:]))
    assert 3500 < azure[-1].at_s < 3700  # one hour


def test_mooncake_prompts_share_text_where_they_share_hash_ids() -> None:
    recs = (TraceRecord(0.0, 1200, 10, (1, 2, 3)), TraceRecord(1.0, 1100, 10, (1, 2, 9)), TraceRecord(3.0, 700, 5, (4, 5)))
    wl = Workload(DIST, DIST, trace=recs, trace_name="mooncake")
    a, b, c = wl.specs([0.0, 0.5, 1.0])
    shared = 2 * TRACE_BLOCK_TOKENS
    assert encode_prompt(a.prompt)[:shared + 1] == encode_prompt(b.prompt)[:shared + 1]  # BOS + two blocks
    assert encode_prompt(a.prompt)[shared + 1:shared + 20] != encode_prompt(b.prompt)[shared + 1:shared + 20]
    assert len(encode_prompt(a.prompt)) == 1 + 1200 and a.prompt_tokens == 1200 and c.output_tokens == 5
    assert [s.at for s in (a, b, c)] == [0.0, 1.0 / 3.0, 1.0]  # the trace's gaps, scaled to the window
    assert wl.kind == "mooncake" and wl.mean_output_tokens() == 25 / 3
    # another phase: other text for the same ids (the benchmark empties the caches between phases)
    from narwhal_serve.bench.workload import _trace_block

    assert _trace_block(0, 1, 1, 512) != _trace_block(0, 0, 1, 512) == a.prompt[:len(_trace_block(0, 0, 1, 512))]


def test_oracle_hit_rate() -> None:
    recs = [TraceRecord(0, 1024, 1, (1, 2)), TraceRecord(0, 1024, 1, (1, 2)), TraceRecord(0, 1024, 1, (1, 3))]
    # the second finds both blocks, the third the first: 1536 of 3072 prompt tokens
    assert oracle_hit_rate(recs) == 0.5
    assert oracle_hit_rate([TraceRecord(0, 700, 1, (1, 2)), TraceRecord(0, 700, 1, (1, 2))]) == 512 / 1400


def test_mixed_script_prompts_are_underestimated_by_characters() -> None:
    wl = Workload(LengthDist(200, 0.0, 200, 200), DIST, mixed=True)
    spec = wl.specs([0.0])[0]
    assert wl.kind == "mixed-script" and any("\u4e00" <= ch <= "\u9fff" for ch in spec.prompt)
    assert "def f(x)" in spec.prompt or "for i in" in spec.prompt
    assert len(encode_prompt(spec.prompt)) > estimate_tokens(len(spec.prompt))
