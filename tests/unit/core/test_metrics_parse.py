"""The /metrics reader looks only at lines starting with a name it reads; it reads exactly what the
definition below reads — each sample line parsed by prometheus_client's own parser — on a real vLLM
page, the simulator's and random text."""

from __future__ import annotations

import math
import pathlib
import random

from prometheus_client.parser import _parse_sample

from narwhal_serve.engines.metrics import _CACHE_INFO, _COPY_LABELS, _NAMES, EngineLoad, parse_engine_metrics
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.engine import Engine
from narwhal_serve.sim.metrics import render_metrics

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32.0-cpu" / "metrics_excerpt.txt"


def _by_lines(text: str) -> EngineLoad:
    """The definition: every line that starts with a metric name, parsed by prometheus_client (a line
    it refuses is skipped); a value that is not finite is skipped; for vLLM's cache-config info the
    value is block_size × num_gpu_blocks of its labels; the copies of one label set that differ only
    in SGLang's rank labels count once (the largest); the rest add up, KV usage takes the largest."""
    groups: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.split("\n"):
        if not line or not (line[0].isalpha() or line[0] in "_:"):
            continue
        try:
            s = _parse_sample(line)
        except Exception:  # noqa: BLE001 — the definition: what the parser refuses is not a sample
            continue
        if s.name == _CACHE_INFO:
            try:
                value = float(max(0, int(s.labels["block_size"]) * int(s.labels["num_gpu_blocks"])))
            except (KeyError, ValueError):
                value = 0.0
        elif s.name in _NAMES:
            value = float(s.value)
        else:
            continue
        if not math.isfinite(value):
            continue
        key = (s.name, frozenset((k, v) for k, v in s.labels.items() if k not in _COPY_LABELS))
        groups[key] = max(groups.get(key, value), value)
    acc = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "kv_tokens": 0.0}
    for (name, _), value in groups.items():
        field = "kv_tokens" if name == _CACHE_INFO else _NAMES[name]
        acc[field] = max(acc[field], value) if field == "kv_usage" else acc[field] + value
    return EngineLoad(acc["running"], acc["waiting"], acc["kv_usage"], max(0, int(acc["kv_tokens"])))


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
    labels = ["", "{}", '{engine="0"}', '{engine="1",model_name="a b"}', "{", '{le="+Inf"}',
              '{model_name="q\\"} x",engine="0"}', '{tp_rank="1",dp_rank="0"}', '{tp_rank="0",dp_rank="0"}',
              '{dp_rank="1", tp_rank="0",}', '{a="\\\\",b="\\n"}']
    values = ["1", "2.5", "0", "-3", "nan", "+Inf", "x", "", "1e3", "4 1700000000", "7\t1700000000"]
    for _ in range(300):
        lines = []
        for _ in range(rng.randint(0, 12)):
            if rng.random() < 0.15:
                blocks = rng.choice(['num_gpu_blocks="950"', 'block_size="16",num_gpu_blocks="10"', "",
                                     'block_size="16",engine="1",num_gpu_blocks="7"'])
                lines.append(f'{_CACHE_INFO}{{{blocks}}} 1.0')
            else:
                sep = rng.choice([" ", "", "  "])
                lines.append(f"{rng.choice(names)}{rng.choice(labels)}{sep}{rng.choice(values)}")
        text = rng.choice(["\n", "\n\n"]).join(lines) + rng.choice(["", "\n"])
        assert repr(parse_engine_metrics(text)) == repr(_by_lines(text)), text  # (nan equal to nan)


def test_a_vllm_sized_page_reads_as_the_definition() -> None:
    """A page of vLLM's size (the read lines among ~1,400 histogram lines, the same label sets read
    again from the cache of label sets), and a sample's labels are the caller's own to change."""
    from narwhal_serve.engines.metrics import parse_sample

    sim = render_metrics(Engine(SimEngineConfig()))
    extra = []
    for h in range(40):
        n = f"vllm:hist_{h}_seconds"
        extra += [f"# HELP {n} x", f"# TYPE {n} histogram"]
        extra += [f'{n}_bucket{{engine="0",le="{b / 10}",model_name="m"}} {b * 3}.0' for b in range(30)]
    page = FIXTURE.read_text() + "\n".join(extra) + "\n" + sim
    for _ in range(2):
        assert parse_engine_metrics(page) == _by_lines(page)
    line = 'vllm:num_requests_running{engine="0",model_name="m"} 3'
    first = parse_sample(line)
    assert first is not None
    first[1]["engine"] = "changed"
    assert parse_sample(line) == ("vllm:num_requests_running", {"engine": "0", "model_name": "m"}, 3.0)
