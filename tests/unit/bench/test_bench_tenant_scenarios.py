"""``narwhal-bench goodput --tenants``: the scenarios warm up and run only the targets the run has
(``--budget-s 0`` starts no three-replica application, so nothing may be sent to it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from narwhal_serve.bench import tenants
from narwhal_serve.bench.goodput import GoodputArgs


@dataclass(frozen=True)
class _Shape:
    extra_headers: tuple[tuple[str, str], ...] = ()


@dataclass
class _Run:
    shape: _Shape = field(default_factory=_Shape)
    log: list[Any] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)

    async def calibrate(self) -> dict[str, Any]:
        return {"capacity_rps": 5.0}

    async def open_run(self, target: str, label: str, rate: float, seed: int, duration_s: float | None = None) -> list[Any]:
        self.sent.append(target)
        return []


@pytest.mark.parametrize("budget_s", [0.0, 30.0])
def test_only_the_targets_the_run_has_are_warmed_up(budget_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(run: Any, target: str, *args: Any) -> dict[str, Any]:
        run.sent.append(target)
        return {"scenario": args[0], "target": target}

    async def budget(run: Any, *args: Any) -> dict[str, Any]:
        run.sent.append(tenants.TENANTS3)
        return {"scenario": "budget", "target": tenants.TENANTS3}

    monkeypatch.setattr(tenants, "_scenario", scenario)
    monkeypatch.setattr(tenants, "_budget", budget)
    monkeypatch.setattr(tenants, "tenant_checks", lambda rows, ttft_ms: [])
    run = _Run()
    asyncio.run(tenants.run_tenant_scenarios(GoodputArgs(), run, budget_s))  # type: ignore[arg-type]
    assert (tenants.TENANTS3 in run.sent) == (budget_s > 0)
    assert {tenants.BASELINE, tenants.TENANTS} <= set(run.sent)
