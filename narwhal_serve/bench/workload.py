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
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Arrival = Literal["poisson", "constant", "burst"]
Api = Literal["chat", "completions"]
WorkloadKind = Literal["lognormal", "shared-prefix"]

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


@dataclass(frozen=True)
class Workload:
    """Lognormal prompt and output lengths; with ``prefix_groups`` K > 0, each prompt is the
    ``prefix_tokens``-word prefix of one of K groups (uniformly drawn) plus ``prompt_len`` words of
    its own (the suffix)."""

    prompt_len: LengthDist
    output_len: LengthDist
    seed: int = 0
    prefix_groups: int = 0
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prefix_groups < 0 or self.prefix_tokens < 0 or (self.prefix_groups > 0) != (self.prefix_tokens > 0):
            raise ValueError(f"bad shared prefix: {self.prefix_groups} groups of {self.prefix_tokens} tokens")

    @property
    def kind(self) -> WorkloadKind:
        return "shared-prefix" if self.prefix_groups else "lognormal"

    def mean_prompt_tokens(self) -> float:
        return self.prefix_tokens + self.prompt_len.mean()

    def specs(self, times: list[float], seed_offset: int = 0) -> list[RequestSpec]:
        rng = np.random.default_rng([self.seed, seed_offset])
        n = len(times)
        prompts = self.prompt_len.sample(rng, n)
        outputs = self.output_len.sample(rng, n)
        if not self.prefix_groups:
            return [RequestSpec(i, t, p, o, make_prompt(rng, p))
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
