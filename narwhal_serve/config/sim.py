"""Configuration of one simulated engine (:class:`SimEngineConfig`) and the fault/script names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FAULT_NAMES: frozenset[str] = frozenset(
    {
        "error_500",
        "error_429",
        "error_503",
        "hang",
        "hang_mid_stream",
        "reset_mid_stream",
        "malformed_sse",
        "error_mid_stream",
        "bad_token_ids",
        "missing_token_ids",
        "negative_token_ids",
        "missing_usage",
        "unhealthy",
        "stale_metrics",
        "unsupported_field",
        "tool_call_no_id",
    }
)
"""Every fault the simulator knows; per request (``sim.fault``) or engine-wide (``faults``)."""

SCRIPT_NAMES: frozenset[str] = frozenset(
    {"reasoning", "reasoning_content", "tool_calls", "refusal", "function_call"}
)
"""Scripted chat outputs selectable per request with ``sim.script``."""

TIMING_FIELDS: tuple[str, ...] = (
    "prefill_overhead_s",
    "prefill_per_token_s",
    "tpot_base_s",
    "tpot_per_running_s",
)


class SimEngineConfig(BaseModel):
    """One simulated vLLM/SGLang/OpenAI-compatible engine."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "sim0"
    role: Literal["prefill", "decode", "unified"] = "unified"
    dialect: Literal["vllm", "sglang", "openai"] = "vllm"
    model: str = "narwhal-sim"
    seed: int = 0
    max_num_seqs: int = Field(default=64, ge=1)
    max_model_len: int = Field(default=4096, ge=1)
    prefill_overhead_s: float = Field(default=0.002, ge=0.0)
    prefill_per_token_s: float = Field(default=0.00002, ge=0.0)
    tpot_base_s: float = Field(default=0.002, ge=0.0)
    tpot_per_running_s: float = Field(default=0.0001, ge=0.0)
    default_max_tokens: int = Field(default=16, ge=1)
    kv_block_size: int = Field(default=16, ge=1)
    prefill_mode: Literal["serial", "parallel"] = "serial"
    """``serial``: prefills run one at a time in arrival order (as vLLM's per-step token budget makes
    them add up); ``parallel``: each request's prefill takes its own time whatever else is waiting."""
    num_gpu_blocks: int = Field(default=4096, ge=1)
    """KV-cache capacity in blocks: bounds the prefix cache and scales ``kv_cache_usage_perc``."""
    cache_output_blocks: bool = True
    """As vLLM: the blocks a request's output fills are cached (and announced) as each fills. The
    trace replay's engine (narwhal_serve/replay/engine.py) counts tokens between events and caches
    prompts only: its equality test with the simulator runs both without."""
    # vLLM --scheduling-policy priority: waiting requests are admitted by their `priority` (lower
    # first), then arrival; without it a request with a non-zero priority is refused, as vLLM does
    priority_scheduling: bool = False
    kv_events_endpoint: str | None = None
    """Publish KV-cache events here as vLLM does (``--kv-events-config``), e.g. ``tcp://127.0.0.1:5557``."""
    kv_events_replay_endpoint: str | None = None
    kv_events_buffer_steps: int = Field(default=10_000, ge=1)
    eos_prob: float = Field(default=0.005, ge=0.0, le=1.0)
    """Per-token probability (after ``min_tokens``) of a deterministic simulated EOS."""
    faults: list[str] = Field(default_factory=list)
    retry_after_s: int = Field(default=1, ge=0)
    """The ``Retry-After`` an ``error_429`` / ``error_503`` answer carries."""

    @field_validator("faults")
    @classmethod
    def _known_faults(cls, v: list[str]) -> list[str]:
        unknown = sorted(set(v) - FAULT_NAMES)
        if unknown:
            raise ValueError(f"unknown fault(s) {unknown}; known: {sorted(FAULT_NAMES)}")
        return v
