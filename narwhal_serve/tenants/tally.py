"""Per-tenant counts for ``/metrics`` and ``/status`` (docs/contract.md, "Tenants"): admitted, goodput, tokens,
terminal classes, budget left.  Labels are the configured tenants only (anything else is ``other``),
so the series are bounded by the config; without a tenants section there are none."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from narwhal_serve.protocol.promtext import escape_label
from narwhal_serve.admission.core import Placement
from narwhal_serve.protocol.outcomes import TERMINAL
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.tenants.amounts import KINDS

OTHER = "other"


@dataclass
class TenantTally:
    tenants: tuple[str, ...]  # configured (empty: no tenants section, nothing counted)
    classes: tuple[str, ...] = ()  # admission.classes, highest first
    served: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, what) -> n
    by_class: Counter[tuple[str, str]] = field(default_factory=Counter)  # (class, what) -> n

    def label(self, tenant: str) -> str | None:
        """The metric label of ``tenant`` (None: no tenants configured, no per-tenant series)."""
        if not self.tenants:
            return None
        return tenant if tenant in self.tenants else OTHER

    def class_label(self, rank: int) -> str | None:
        """The metric label of a priority class rank (None: not a class)."""
        return self.classes[rank] if 0 <= rank < len(self.classes) else None

    def ended(self, tenant: str, p: Placement, stats: RelayStats | None, completed: bool) -> None:
        ttft = None if stats is None else stats.client_ttft_s
        good = completed and ttft is not None and p.ttft_budget_s is not None and ttft <= p.ttft_budget_s
        out = stats.output_tokens if stats is not None else 0
        if (k := self.class_label(p.rank)) is not None:
            self.by_class[(k, "admitted")] += 1
            self.by_class[(k, "goodput")] += good
            self.by_class[(k, "input_tokens")] += p.prompt_tokens
            self.by_class[(k, "output_tokens")] += out
        label = self.label(tenant)
        if label is None:
            return
        self.served[(label, "admitted")] += 1
        self.served[(label, "input_tokens")] += p.prompt_tokens
        self.served[(label, "output_tokens")] += out
        self.served[(label, "goodput")] += good

    def class_view(self, outcomes: Counter[tuple[str, str]]) -> list[dict[str, Any]]:
        """One row per priority class."""
        return [{"class": k, **{w: self.by_class[(k, w)] for w in ("admitted", "goodput", "input_tokens", "output_tokens")},
                 "outcomes": {o.value: outcomes[(k, o.value)] for o in TERMINAL}} for k in self.classes]

    def view(self, outcomes: Counter[tuple[str, str]], remaining: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
        """One row per configured tenant (and ``other`` once it counted something)."""
        names = list(self.tenants) + ([OTHER] if any(t == OTHER for t, _ in (*self.served, *outcomes)) else [])
        return [{
            "tenant": t,
            "admitted": self.served[(t, "admitted")],
            "goodput": self.served[(t, "goodput")],
            "input_tokens": self.served[(t, "input_tokens")],
            "output_tokens": self.served[(t, "output_tokens")],
            "outcomes": {o.value: outcomes[(t, o.value)] for o in TERMINAL},
            "budget_remaining": remaining.get(t, {}),
        } for t in names]


def render_classes(rows: list[dict[str, Any]]) -> list[str]:
    out = ["# HELP narwhal_class_requests_total Offered requests by priority class and terminal class",
           "# TYPE narwhal_class_requests_total counter"]
    for r in rows:
        for o, n in sorted(r["outcomes"].items()):
            out.append(f'narwhal_class_requests_total{{class="{escape_label(r["class"])}",outcome="{o}"}} {n}')
    for key in ("admitted", "goodput"):
        out += [f"# TYPE narwhal_class_{key}_total counter"]
        out += [f'narwhal_class_{key}_total{{class="{escape_label(r["class"])}"}} {r[key]}' for r in rows]
    out += ["# TYPE narwhal_class_tokens_total counter"]
    for r in rows:
        for kind in ("input", "output"):
            out.append(f'narwhal_class_tokens_total{{class="{escape_label(r["class"])}",kind="{kind}"}} {r[kind + "_tokens"]}')
    return out


def render_tenants(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = ["# HELP narwhal_tenant_requests_total Offered requests by tenant and terminal class",
           "# TYPE narwhal_tenant_requests_total counter"]
    for r in rows:
        for o, n in sorted(r["outcomes"].items()):
            out.append(f'narwhal_tenant_requests_total{{tenant="{escape_label(r["tenant"])}",outcome="{o}"}} {n}')
    for key, help_text in (("admitted", "Requests admitted (counted when they end)"),
                           ("goodput", "Requests served with their first token within their TTFT target")):
        out += [f"# HELP narwhal_tenant_{key}_total {help_text}, by tenant", f"# TYPE narwhal_tenant_{key}_total counter"]
        out += [f'narwhal_tenant_{key}_total{{tenant="{escape_label(r["tenant"])}"}} {r[key]}' for r in rows]
    out += ["# HELP narwhal_tenant_tokens_total Prompt tokens and validated output tokens served, by tenant",
            "# TYPE narwhal_tenant_tokens_total counter"]
    for r in rows:
        for kind in ("input", "output"):
            out.append(f'narwhal_tenant_tokens_total{{tenant="{escape_label(r["tenant"])}",kind="{kind}"}} {r[kind + "_tokens"]}')
    out += ["# HELP narwhal_tenant_budget_remaining What is left of each budget of the tenant, router-wide "
            "(per-minute buckets; concurrent: free slots)",
            "# TYPE narwhal_tenant_budget_remaining gauge"]
    for r in rows:
        for kind in KINDS:
            if kind in r["budget_remaining"]:
                out.append(f'narwhal_tenant_budget_remaining{{tenant="{escape_label(r["tenant"])}",budget="{kind}"}} '
                           f'{round(r["budget_remaining"][kind], 3)}')
    return out
