"""Reading the few engine /metrics lines a router needs (Prometheus text format): vLLM's names (and
their older spellings) and SGLang's."""

from __future__ import annotations

import functools
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
        value = m.group(2)
        labels[m.group(1)] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
        pos = m.end()
        if not m.group(3):
            break
    while pos < len(line) and line[pos] in " \t":
        pos += 1
    return (labels, pos + 1) if line.startswith("}", pos) else None


def _unescape(e: re.Match[str]) -> str:
    return _UNESCAPED.get(e.group(1), e.group(0))


@functools.lru_cache(maxsize=4096)
def _label_block(block: str) -> tuple[dict[str, str], frozenset[tuple[str, str]]] | None:
    """A whole label set, ``{...}`` (an engine sends the same few every scrape: read once): its
    labels (not to be changed: shared) and them without SGLang's rank labels; None: malformed."""
    parsed = _labels(block, 0)
    if parsed is None or parsed[1] != len(block):
        return None
    labels = parsed[0]
    return labels, frozenset((k, v) for k, v in labels.items() if k not in _COPY_LABELS)


def _number(text: str) -> float | None:
    """A value or timestamp field as prometheus_client reads one (no ``_``; None: not a number)."""
    if "_" in text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _value(rest: str) -> float | None:
    """The value of what follows a sample's name and labels, ``value [timestamp]``, read as
    prometheus_client reads it: fields split at spaces (at tabs when there is no space), the first
    the value, the last, when there are more, a timestamp that must be a number too."""
    rest = rest.lstrip()
    fields = [f for f in rest.split(" " if " " in rest else "\t") if f.strip()]
    if not fields:
        return None
    value = _number(fields[0].strip())
    if value is None or (len(fields) > 1 and _number(fields[-1].strip()) is None):
        return None
    return value if math.isfinite(value) else None


def _sample(line: str) -> tuple[str, dict[str, str], frozenset[tuple[str, str]], float] | None:
    """:func:`parse_sample`, with the labels less SGLang's rank labels."""
    brace = line.find("{")
    gap = min((i for i in (line.find(" "), line.find("\t")) if i >= 0), default=-1)
    if brace >= 0 and (gap < 0 or not line[gap:brace].strip()):
        close = line.rfind("}")  # (a value or timestamp has none: the label set ends at the last one)
        block = _label_block(line[brace:close + 1])
        if block is None:
            return None
        name, (labels, group), end = line[:brace].rstrip(), block, close + 1
    elif gap < 0:
        return None
    else:
        name, labels, group, end = line[:gap], {}, frozenset(), gap
    value = _value(line[end:])
    return None if value is None else (name, labels, group, value)


def parse_sample(line: str) -> tuple[str, dict[str, str], float] | None:
    """One sample line, ``name[{labels}] value [timestamp]``: its name, labels and value (None:
    malformed, or a value that is not a finite number — NaN and ±Inf say nothing a router can add)."""
    s = _sample(line)
    return None if s is None else (s[0], dict(s[1]), s[3])


def _kv_tokens(labels: dict[str, str]) -> float:
    """block_size × num_gpu_blocks from vLLM's cache-config info labels (0 when absent or odd)."""
    try:
        return float(max(0, int(labels["block_size"]) * int(labels["num_gpu_blocks"])))
    except (KeyError, ValueError, OverflowError):  # (past a float's range: as odd as a word)
        return 0.0


def _alternatives(prefix: str) -> str:
    return "|".join(re.escape(n[len(prefix):]) for n in sorted(_READ, key=len, reverse=True) if n.startswith(prefix))


# the lines read: those starting with a name read, then a space, a tab or a label set (most of a page
# is histograms; the names grouped by their prefix, so the search is one pass in C: 3-4x fewer µs on
# a vLLM-sized page than a Python loop over its lines)
_READ = (*_NAMES, _CACHE_INFO)
assert all(n.startswith(("vllm:", "sglang:")) for n in _READ)
_READ_LINE = re.compile(f"\n(?:vllm:(?:{_alternatives('vllm:')})|sglang:(?:{_alternatives('sglang:')}))(?=[ \t{{])[^\n]*")


def parse_engine_metrics(text: str) -> EngineLoad:
    """Each known gauge over its label sets: the copies of one batch (SGLang's ranks) count once, the
    engine cores and data-parallel groups add up (KV usage: the fullest one); unknown lines, and
    values that are not finite numbers, are ignored."""
    seen: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for m in _READ_LINE.finditer("\n" + text):
        sample = _sample(m.group()[1:].rstrip("\r"))
        if sample is None:
            continue
        name, labels, group, value = sample
        if name == _CACHE_INFO:
            value = _kv_tokens(labels)
        elif name not in _NAMES:
            continue
        seen[name, group] = max(seen.get((name, group), value), value)
    acc = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "kv_tokens": 0.0}
    for (name, _), value in seen.items():
        key = "kv_tokens" if name == _CACHE_INFO else _NAMES[name]
        acc[key] = max(acc[key], value) if key == "kv_usage" else acc[key] + value
    return EngineLoad(acc["running"], acc["waiting"], acc["kv_usage"], max(0, int(acc["kv_tokens"])))
