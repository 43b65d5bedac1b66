"""Reading the few vLLM /metrics lines a router needs (Prometheus text format)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAMES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    # SGLang's names for the same facts
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
}


@dataclass(frozen=True)
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    kv_tokens: int = 0  # KV-cache capacity in tokens (vllm:cache_config_info); 0: not reported


_CACHE_INFO = "vllm:cache_config_info{"
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _kv_tokens(line: str) -> int:
    """block_size × num_gpu_blocks from vLLM's cache-config info gauge (0 when absent or odd)."""
    labels = dict(_LABEL.findall(line[len(_CACHE_INFO):line.rfind("}")]))
    try:
        return max(0, int(labels["block_size"]) * int(labels["num_gpu_blocks"]))
    except (KeyError, ValueError):
        return 0


_READ = (*_NAMES, _CACHE_INFO)  # a line is read only if it starts with one of these (most of a page is histograms)


def parse_engine_metrics(text: str) -> EngineLoad:
    """Sum each known gauge over its label sets (its name ends at ``{`` or a space; the line's last
    field is its value); unknown lines are ignored."""
    acc = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    kv_tokens = 0
    for line in text.split("\n"):
        if not line.startswith(_READ):
            continue
        if line.startswith(_CACHE_INFO):
            kv_tokens += _kv_tokens(line)  # one line per engine core (data parallel: summed)
            continue
        ends = [i for i in (line.find("{"), line.find(" ")) if i >= 0]
        key = _NAMES.get(line[:min(ends)] if ends else line)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if key == "kv_usage":
            acc[key] = max(acc[key], value)
        else:
            acc[key] += value
    return EngineLoad(acc["running"], acc["waiting"], acc["kv_usage"], kv_tokens)
