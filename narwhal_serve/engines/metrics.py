"""Reading the few vLLM /metrics lines a router needs (Prometheus text format)."""

from __future__ import annotations

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


def parse_engine_metrics(text: str) -> EngineLoad:
    """Sum each known gauge over its label sets; unknown lines are ignored."""
    acc = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for i, c in enumerate(line):
            if c == "{" or c == " ":
                name_end = i
                break
        key = _NAMES.get(line[:name_end])
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
    return EngineLoad(acc["running"], acc["waiting"], acc["kv_usage"])
