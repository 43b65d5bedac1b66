"""Synthetic workloads: arrival times, heavy-tailed lengths, prompts and request bodies.

Everything is seeded and pure (no clock, no I/O), so a workload can be rebuilt exactly from its
parameters.  Prompts are made of 3-letter words, each one token for the simulator's tokenizer and
about one (``chars / 4``) for Narwhal's sizing.  In the default (``lognormal``) workload every prompt
starts with words of its own, so the simulated prefix cache never shortens a prefill; in the
``shared-prefix`` one (``prefix_groups > 0``) every prompt is one of K fixed group prefixes followed
by words of its own, so an engine that served the group before prefills only the suffix.
"""

from __future__ import annotations

import functools
import math
import string
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from narwhal_serve.replay.trace import TRACE_BLOCK_TOKENS, TraceRecord

Arrival = Literal["poisson", "constant", "burst"]
Api = Literal["chat", "completions"]
WorkloadKind = Literal["lognormal", "shared-prefix", "mooncake", "azure", "mixed-script"]

_LETTERS = np.array(list(string.ascii_lowercase))


@dataclass(frozen=True)
class LengthDist:
    """Lognormal with ``median`` and log-space ``sigma``, rounded and clipped to ``[lo, hi]``."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.lo <= self.hi):
            raise ValueError(f"bad length distribution {self}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        raw = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return [int(v) for v in np.clip(np.rint(raw), self.lo, self.hi)]

    def mean(self, n: int = 20_000, seed: int = 12345) -> float:
        """Mean of the clipped distribution (Monte Carlo, deterministic)."""
        return float(np.mean(self.sample(np.random.default_rng(seed), n)))


def arrival_times(kind: Arrival, rate: float, duration_s: float, rng: np.random.Generator,
                  burst_size: int = 8, max_requests: int = 1_000_000) -> list[float]:
    """Send offsets in ``[0, duration_s)`` for a mean ``rate`` (requests per second).

    ``poisson``: exponential gaps; ``constant``: one every ``1/rate``; ``burst``: ``burst_size``
    requests at once every ``burst_size/rate`` seconds.
    """
    if rate <= 0 or duration_s <= 0:
        return []
    out: list[float] = []
    if kind == "poisson":
        t = 0.0
        while len(out) < max_requests:
            t += float(rng.exponential(1.0 / rate))
            if t >= duration_s:
                break
            out.append(t)
    elif kind == "constant":
        n = min(max_requests, math.ceil(duration_s * rate))
        out = [i / rate for i in range(n) if i / rate < duration_s]
    elif kind == "burst":
        if burst_size < 1:
            raise ValueError("burst_size must be >= 1")
        period = burst_size / rate
        t = 0.0
        while t < duration_s and len(out) < max_requests:
            out.extend([t] * min(burst_size, max_requests - len(out)))
            t += period
    else:
        raise ValueError(f"unknown arrival kind {kind!r}")
    return out


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: when (offset from the run start), how long a prompt, how many tokens."""

    idx: int
    at: float
    prompt_tokens: int
    output_tokens: int
    prompt: str
    group: int | None = None  # shared-prefix workload: the prompt's prefix group


def make_prompt(rng: np.random.Generator, n_tokens: int) -> str:
    """``n_tokens`` random 3-letter words, space separated (one simulator token each)."""
    letters = _LETTERS[rng.integers(0, 26, size=(max(1, n_tokens), 3))]
    return " ".join("".join(w) for w in letters)


@functools.lru_cache(maxsize=64)
def group_prefix(seed: int, group: int, n_tokens: int, phase: int = 0) -> str:
    """The common prefix of ``group``: ``n_tokens`` words fixed by ``(seed, group, phase)`` alone.

    Each phase of a run (``Workload.specs``' ``seed_offset``) has its own prefixes: the benchmark
    empties the engines' prefix caches between phases, and a router that remembered where the
    last phase's prefixes went would otherwise start each phase crediting caches the engines no
    longer have (a state no deployment reaches), learning a false miss rate from it."""
    return make_prompt(np.random.default_rng([seed, 0x5EED, group, phase]), n_tokens)


def oracle_hit_rate(records: list[TraceRecord], block_tokens: int = TRACE_BLOCK_TOKENS) -> float:
    """The prefix-cache hit rate of an oracle placement (every request on an engine that holds every
    block chain seen before it, an unbounded cache): prompt tokens in leading blocks whose chain
    appeared earlier, over all prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in records:
        total += r.input_tokens
        lead = True
        for k in range(len(r.hash_ids)):
            chain = r.hash_ids[:k + 1]
            full = (k + 1) * block_tokens <= r.input_tokens
            if lead and chain in seen and full:
                hit += block_tokens
            else:
                lead = False
            seen.add(chain)
    return hit / total if total else 0.0


# Mixed scripts: English words, code and CJK (a CJK character is one or more tokens for common
# tokenizers; the characters / 4 estimate sizes it as a quarter of one)
_MIXED = ("the", "router", "token", "cache", "def f(x): return x", "for i in range(n):", "{\"k\": [1, 2]}",
          "東京", "数据", "中心", "路由器", "한국어", "ラーメン", "今日は")


def mixed_prompt(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(_MIXED[i] for i in rng.integers(0, len(_MIXED), size=max(1, n_words)))


@functools.lru_cache(maxsize=8192)
def _trace_block(seed: int, phase: int, hash_id: int, n_tokens: int) -> str:
    return make_prompt(np.random.default_rng([seed, 0xB10C, phase, hash_id]), n_tokens)


@dataclass(frozen=True)
class Workload:
    """Lognormal prompt and output lengths; with ``prefix_groups`` K > 0, each prompt is the
    ``prefix_tokens``-word prefix of one of K groups (uniformly drawn) plus ``prompt_len`` words of
    its own (the suffix).  With ``trace`` (``trace_name`` mooncake or azure), lengths, arrival pattern
    and shared prefix blocks come from a real trace.  ``mixed`` prompts mix English, code and CJK."""

    prompt_len: LengthDist
    output_len: LengthDist
    seed: int = 0
    prefix_groups: int = 0
    prefix_tokens: int = 0
    trace: tuple[TraceRecord, ...] = field(default=(), repr=False)
    trace_name: str = ""
    max_prompt_tokens: int = 1 << 30  # trace prompts are clipped to this (the engines' context)
    mixed: bool = False

    def __post_init__(self) -> None:
        if self.prefix_groups < 0 or self.prefix_tokens < 0 or (self.prefix_groups > 0) != (self.prefix_tokens > 0):
            raise ValueError(f"bad shared prefix: {self.prefix_groups} groups of {self.prefix_tokens} tokens")

    @property
    def kind(self) -> WorkloadKind:
        if self.trace:
            return "mooncake" if self.trace_name == "mooncake" else "azure"
        if self.mixed:
            return "mixed-script"
        return "shared-prefix" if self.prefix_groups else "lognormal"

    def mean_prompt_tokens(self) -> float:
        if self.trace:
            return float(np.mean([min(r.input_tokens, self.max_prompt_tokens) for r in self.trace]))
        return self.prefix_tokens + self.prompt_len.mean()

    def mean_output_tokens(self) -> float:
        if self.trace:
            return float(np.mean([r.output_tokens for r in self.trace]))
        return self.output_len.mean()

    def trace_slice(self, n: int, seed_offset: int) -> list[TraceRecord]:
        """``n`` consecutive records (wrapping), a different stretch of the trace for each phase."""
        if not self.trace:
            return []
        start = (seed_offset * 7919 + self.seed * 104729) % len(self.trace)
        return [self.trace[(start + i) % len(self.trace)] for i in range(n)]

    def _trace_specs(self, times: list[float], seed_offset: int) -> list[RequestSpec]:
        recs = self.trace_slice(len(times), seed_offset)
        if not recs:
            return []
        # the trace's own arrival pattern, scaled to the window the requested rate gives
        t0 = recs[0].at_s
        span = max(r.at_s for r in recs) - t0
        scale = (times[-1] / span) if span > 0 and times[-1] > 0 else 0.0
        out = []
        for i, (r, t) in enumerate(zip(recs, times)):
            n = max(1, min(r.input_tokens, self.max_prompt_tokens))
            if r.hash_ids:
                parts = []
                for k, h in enumerate(r.hash_ids):
                    size = min(TRACE_BLOCK_TOKENS, n - k * TRACE_BLOCK_TOKENS)
                    if size <= 0:
                        break
                    parts.append(_trace_block(self.seed, seed_offset, h, size))
                prompt = " ".join(parts)
            else:
                prompt = make_prompt(np.random.default_rng([self.seed, seed_offset, i]), n)
            at = (r.at_s - t0) * scale if scale else t
            out.append(RequestSpec(i, at, n, max(1, r.output_tokens), prompt))
        return out

    def specs(self, times: list[float], seed_offset: int = 0) -> list[RequestSpec]:
        if self.trace:
            return self._trace_specs(times, seed_offset)
        rng = np.random.default_rng([self.seed, seed_offset])
        n = len(times)
        prompts = self.prompt_len.sample(rng, n)
        outputs = self.output_len.sample(rng, n)
        if not self.prefix_groups:
            make = mixed_prompt if self.mixed else make_prompt
            return [RequestSpec(i, t, p, o, make(rng, p))
                    for i, (t, p, o) in enumerate(zip(times, prompts, outputs))]
        groups = [int(g) for g in rng.integers(0, self.prefix_groups, size=n)]
        return [RequestSpec(i, t, self.prefix_tokens + p, o,
                            group_prefix(self.seed, g, self.prefix_tokens, seed_offset) + " " + make_prompt(rng, p), g)
                for i, (t, p, o, g) in enumerate(zip(times, prompts, outputs, groups))]

    def closed_loop_specs(self, n: int, seed_offset: int = 0) -> list[RequestSpec]:
        """``n`` requests without send times (closed-loop clients take them in order)."""
        return self.specs([0.0] * n, seed_offset)


def build_body(spec: RequestSpec, api: Api, model: str, stream: bool, ignore_eos: bool = True,
               include_usage: bool = True) -> dict[str, Any]:
    """An OpenAI request for ``spec``: ``max_tokens`` = its output length (with ``ignore_eos``);
    streaming ones ask for the usage chunk unless ``include_usage`` is off."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_tokens, "stream": stream, "temperature": 0}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def api_path(api: Api) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"
