"""Reading the few engine /metrics lines a router needs (Prometheus text format): vLLM's names (and
their older spellings) and SGLang's."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_NAMES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM before 0.9.2 (renamed then, removed in 0.12)
    # SGLang's names for the same facts
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    # a P/D decode engine's requests waiting for KV memory and for the KV itself (vLLM counts both
    # in num_requests_waiting; SGLang's num_queue_reqs is its waiting queue alone)
    "sglang:num_decode_prealloc_queue_reqs": "waiting",
    "sglang:num_decode_transfer_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "sglang:max_total_num_tokens": "kv_tokens",  # the KV pool, in tokens
}
_CACHE_INFO = "vllm:cache_config_info"  # block_size × num_gpu_blocks in its labels, one line per engine core
# SGLang with --enable-metrics-for-all-schedulers: every tensor / pipeline / expert-parallel rank
# publishes the same batch, told apart by these labels alone (data-parallel groups hold different
# requests: dp_rank, like vLLM's engine label, is summed over)
_COPY_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})


@dataclass(frozen=True)
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    kv_tokens: int = 0  # KV-cache capacity in tokens (vllm:cache_config_info, sglang:max_total_num_tokens); 0: not reported


_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*(,?)')
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"n": "\n", "\\": "\\", '"': '"'}


def _labels(line: str, at: int) -> tuple[dict[str, str], int] | None:
    """The label set that opens at ``line[at] == "{"`` (values unescaped as the text format escapes
    them: backslash, double quote, newline) and the index just past its ``}``; None: malformed."""
    labels: dict[str, str] = {}
    pos = at + 1
    while True:
        m = _LABEL.match(line, pos)
        if m is None:
            break
        labels[m.group(1)] = _ESCAPE.sub(lambda e: _UNESCAPED.get(e.group(1), e.group(0)), m.group(2))
        pos = m.end()
        if not m.group(3):
            break
    while pos < len(line) and line[pos] in " \t":
        pos += 1
    return (labels, pos + 1) if line.startswith("}", pos) else None


def parse_sample(line: str) -> tuple[str, dict[str, str], float] | None:
    """One sample line, ``name[{labels}] value [timestamp]``: its name, labels and value (None:
    malformed, or a value that is not a finite number — NaN and ±Inf say nothing a router can add)."""
    brace, space = line.find("{"), line.find(" ")
    if brace >= 0 and (space < 0 or not line[space:brace].strip()):
        parsed = _labels(line, brace)
        if parsed is None:
            return None
        name, (labels, end) = line[:brace].rstrip(), parsed
    elif space < 0:
        return None
    else:
        name, labels, end = line[:space], {}, space
    fields = line[end:].split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return (name, labels, value) if math.isfinite(value) else None


def _kv_tokens(labels: dict[str, str]) -> float:
    """block_size × num_gpu_blocks from vLLM's cache-config info labels (0 when absent or odd)."""
    try:
        return float(max(0, int(labels["block_size"]) * int(labels["num_gpu_blocks"])))
    except (KeyError, ValueError):
        return 0.0


_READ = (*_NAMES, _CACHE_INFO)  # a line is read only if it starts with one of these (most of a page is histograms)


def parse_engine_metrics(text: str) -> EngineLoad:
    """Each known gauge over its label sets: the copies of one batch (SGLang's ranks) count once, the
    engine cores and data-parallel groups add up (KV usage: the fullest one); unknown lines, and
    values that are not finite numbers, are ignored."""
    seen: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.split("\n"):
        if not line.startswith(_READ):
            continue
        sample = parse_sample(line.rstrip("\r"))
        if sample is None:
            continue
        name, labels, value = sample
        if name == _CACHE_INFO:
            value = _kv_tokens(labels)
        elif name not in _NAMES:
            continue
        group = (name, frozenset((k, v) for k, v in labels.items() if k not in _COPY_LABELS))
        seen[group] = max(seen.get(group, value), value)
    acc = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "kv_tokens": 0.0}
    for (name, _), value in seen.items():
        key = "kv_tokens" if name == _CACHE_INFO else _NAMES[name]
        acc[key] = max(acc[key], value) if key == "kv_usage" else acc[key] + value
    return EngineLoad(acc["running"], acc["waiting"], acc["kv_usage"], max(0, int(acc["kv_tokens"])))
