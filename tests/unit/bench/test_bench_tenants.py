"""The tenant scenarios' arithmetic and config: Jain's index, the checks, the target's tenants."""

from __future__ import annotations

import hashlib

import pytest

from narwhal_serve.bench.fleet import TENANT_KEYS, narwhal_serve_config
from narwhal_serve.bench.tenants import BASELINE, TENANTS, TENANTS3, jain, tenant_checks
from narwhal_serve.config import NarwhalConfig


def test_jain_index() -> None:
    assert jain([1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0]) == 0.5
    assert jain([3.0, 1.0]) == pytest.approx(0.8)
    assert jain([0.0, 0.0]) is None and jain([]) is None


def test_checks_read_the_tenants_target_only() -> None:
    def row(scenario: str, target: str, a: dict[str, object], b: dict[str, object], **kw: object) -> dict[str, object]:
        return {"scenario": scenario, "target": target, "tenants": {"a": a, "b": b}, **kw}

    good_b = {"goodput_vs_offered": 0.97, "slo_attainment_admitted": 1.0}
    rows = [row("noisy-neighbour", BASELINE, {}, {"goodput_vs_offered": 0.4, "slo_attainment_admitted": 0.5}),
            row("noisy-neighbour", TENANTS, {}, good_b),
            row("fairness", TENANTS, {}, {}, jain=0.9),
            row("priority", TENANTS, {"ttft_p99_ms": 1500.0}, {}, goodput_vs_capacity=0.95),
            {"scenario": "budget", "target": TENANTS3, "overshoot": 1, "retry_admitted_share": 0.97}]
    verdicts = {c["check"]: c["verdict"] for c in tenant_checks(rows, 2000.0)}
    assert verdicts == {"noisy neighbour: b's goodput / b's offered": "PASS",
                        "noisy neighbour: b admitted within SLO": "PASS",
                        "fairness: Jain's index over goodput": "MISS",
                        "priority: interactive TTFT p99 (ms)": "PASS",
                        "priority: total goodput / capacity": "PASS",
                        "budget: admitted over the bucket bound (requests; < 1: none)": "MISS",
                        "budget: retries after retry-after-ms admitted": "PASS"}


def test_the_tenants_target_is_a_valid_config_with_the_bench_keys() -> None:
    cfg = narwhal_serve_config(8000, ["http://127.0.0.1:9000"], "narwhal-sim", [TENANTS, TENANTS3], 2.0)
    app = next(a for a in cfg["applications"] if a["route_prefix"] == "/tenants-3")
    parsed = NarwhalConfig.model_validate(app["args"])
    assert parsed.tenants is not None and parsed.admission.mode == "predictive"
    digests = {t.name: t.key_sha256[0] for t in parsed.tenants.list}
    assert digests == {t: hashlib.sha256(k.encode()).hexdigest() for t, k in TENANT_KEYS.items()}
    assert parsed.deployment.ingress_min_replicas == parsed.deployment.ingress_max_replicas == 3
    assert [t.name for t in parsed.tenants.list if t.budgeted()] == ["c"]
