"""The /metrics reader looks only at lines starting with a name it reads; it reads exactly what the
character-by-character definition below reads, on a real vLLM page, the simulator's and random
text."""

from __future__ import annotations

import pathlib
import random

from narwhal_serve.engines.metrics import _CACHE_INFO, _NAMES, EngineLoad, _kv_tokens, parse_engine_metrics
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.engine import Engine
from narwhal_serve.sim.metrics import render_metrics

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32.0-cpu" / "metrics_excerpt.txt"


def _by_lines(text: str) -> EngineLoad:
    """The definition: every line, its name up to the first ``{`` or space, its last field the value."""
    acc = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    kv_tokens = 0
    for line in text.split("\n"):
        if not line or line[0] == "#":
            continue
        if line.startswith(_CACHE_INFO):
            kv_tokens += _kv_tokens(line)
            continue
        name_end = len(line)
        for i, c in enumerate(line):
            if c in "{ ":
                name_end = i
                break
        key = _NAMES.get(line[:name_end])
        fields = line.split(" ")
        if key is None or len(fields) < 2:
            continue
        try:
            value = float(fields[-1])
        except ValueError:
            continue
        acc[key] = max(acc[key], value) if key == "kv_usage" else acc[key] + value
    return EngineLoad(acc["running"], acc["waiting"], acc["kv_usage"], kv_tokens)


def test_a_real_vllm_page_and_the_simulators() -> None:
    real = FIXTURE.read_text()
    assert parse_engine_metrics(real) == _by_lines(real)
    sim = render_metrics(Engine(SimEngineConfig()))
    load = parse_engine_metrics(sim)
    assert load == _by_lines(sim) and load.kv_tokens > 0


def test_random_text_reads_as_the_definition() -> None:
    rng = random.Random(7)
    names = [*_NAMES, "vllm:num_requests_running_total", "vllm:num_requests", "#vllm:num_requests_running",
             " vllm:num_requests_running", "vllm:kv_cache_usage_perc_bucket", "sglang:token_usage", "other"]
    labels = ["", "{}", '{engine="0"}', '{engine="1",model_name="a b"}', "{", '{le="+Inf"}']
    values = ["1", "2.5", "0", "-3", "nan", "+Inf", "x", "", "1e3", "4 1700000000"]
    for _ in range(300):
        lines = []
        for _ in range(rng.randint(0, 12)):
            if rng.random() < 0.15:
                blocks = rng.choice(['num_gpu_blocks="950"', 'block_size="16",num_gpu_blocks="10"', ""])
                lines.append(f'{_CACHE_INFO}{blocks}}} 1.0')
            else:
                sep = rng.choice([" ", "", "  "])
                lines.append(f"{rng.choice(names)}{rng.choice(labels)}{sep}{rng.choice(values)}")
        text = rng.choice(["\n", "\n\n"]).join(lines) + rng.choice(["", "\n"])
        assert repr(parse_engine_metrics(text)) == repr(_by_lines(text)), text  # (nan equal to nan)
