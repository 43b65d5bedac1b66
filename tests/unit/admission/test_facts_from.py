"""An engine's facts made by filling their dict (the scheduler's read of an engine, per engine
changed) are the facts the dataclass's own constructor makes."""

from __future__ import annotations

import dataclasses

from narwhal_serve.admission.facts import FACT_FIELDS, EngineFacts, facts_from
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.scheduler.granted import INPUT_FIELDS, facts


def test_facts_from_equal_the_constructors_in_every_field_and_behaviour() -> None:
    values = {
        "cfg": EngineConfig(name="e0", url="http://127.0.0.1:1"), "eligible_until": 12.5, "inflight": 3,
        "load": EngineLoad(2, 1, 0.25, 4096), "pending_prefill_tokens": 700, "ttft_a": 0.01, "ttft_b": 2e-4,
        "slots": 8, "service_s": 1.5, "external": 1, "pending_prefill_requests": 2, "ttft_c": 0.003,
        "tpot_a": 0.02, "tpot_b": 0.001, "tpot_known": True, "decode_tokens": 64.0, "penalty": 0.1,
        "prefix": frozenset({1, 2}), "ttft_margin": 0.05, "ttft_idle_margin": 0.02, "prefix_credit": 0.9,
        "cache_block_tokens": 16,
        "node": "n1", "releases": (13.0, 14.0), "line_since": 11.0, "line_head_tokens": 300, "context": 4096,
    }
    assert values.keys() == FACT_FIELDS  # every field, so none is left to a default
    names = tuple(values)
    made = facts_from(names, values.values())
    built = EngineFacts(**values)
    assert made == built
    assert dataclasses.asdict(made) == dataclasses.asdict(built)
    assert made.row() == built.row() and made.prefilled_tokens(12.0) == built.prefilled_tokens(12.0)
    with_others = dataclasses.replace(made, inflight=5)  # still a frozen dataclass like any other
    assert with_others.inflight == 5 and made.inflight == 3
    # the scheduler's inputs name each field once
    assert sorted(INPUT_FIELDS) == sorted(FACT_FIELDS)
    assert facts(tuple(values[n] for n in INPUT_FIELDS)) == built
