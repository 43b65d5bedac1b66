"""``/metrics``: Prometheus text exposition with vLLM's metric names and labels."""

from __future__ import annotations

from narwhal_serve.protocol.promtext import escape_label
from narwhal_serve.sim.engine import Engine, Histogram


def _fmt(v: float) -> str:
    return repr(float(v))


def _labels(base: dict[str, str], le: str | None = None, **extra: str) -> str:
    """A label set as vLLM's page writes it: sorted by name, a histogram bucket's ``le`` last, values
    escaped."""
    labels = {**base, **extra}
    pairs = [(k, labels[k]) for k in sorted(labels)] + ([("le", le)] if le is not None else [])
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs) + "}"


def _histogram(lines: list[str], name: str, help_: str, h: Histogram, base: dict[str, str]) -> None:
    lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for le, n in zip(h.buckets, h.counts):
        lines.append(f"{name}_bucket{_labels(base, le=_fmt(le))} {_fmt(n)}")
    lines.append(f'{name}_bucket{_labels(base, le="+Inf")} {_fmt(h.count)}')
    lines.append(f"{name}_count{_labels(base)} {_fmt(h.count)}")
    lines.append(f"{name}_sum{_labels(base)} {_fmt(h.sum)}")


def render_metrics(engine: Engine) -> str:
    base = {"engine": "0", "model_name": engine.cfg.model}
    c, sched = engine.counters, engine.scheduler
    lines: list[str] = []

    def gauge(name: str, help_: str, value: float) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{_labels(base)} {_fmt(value)}"])

    def counter(name: str, help_: str, value: float) -> None:
        lines.extend([f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter",
                      f"{name}_total{_labels(base)} {_fmt(value)}"])

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", sched.running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", sched.waiting)
    name = "vllm:num_requests_waiting_by_reason"
    lines += [f"# HELP {name} Number of requests waiting, by reason.", f"# TYPE {name} gauge"]
    lines.append(f"{name}{_labels(base, reason='capacity')} {_fmt(sched.waiting)}")
    lines.append(f"{name}{_labels(base, reason='deferred')} {_fmt(0)}")
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage())
    name = "vllm:cache_config_info"
    lines += [f"# HELP {name} Information of the LLMEngine CacheConfig", f"# TYPE {name} gauge"]
    info = _labels(base, block_size=str(engine.cfg.kv_block_size), num_gpu_blocks=str(engine.cfg.num_gpu_blocks),
                   enable_prefix_caching="True")
    lines.append(f"{name}{info} 1.0")
    counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            engine.cache.queries * engine.cfg.kv_block_size)
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            engine.cache.hits * engine.cfg.kv_block_size)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
    counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
    name = "vllm:request_success_total"
    lines += [f"# HELP {name} Count of successfully processed requests.", f"# TYPE {name} counter"]
    for reason, n in c.success.items():
        lines.append(f"{name}{_labels(base, finished_reason=reason)} {_fmt(n)}")
    _histogram(lines, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
               c.ttft, base)
    _histogram(lines, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
               c.itl, base)
    _histogram(lines, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
               c.e2e, base)
    return "\n".join(lines) + "\n"
