"""Tenants (docs/contract.md, "Tenants"): who sent a request (an API key's tenant) and what it may still use
(per-tenant budgets that hold for the whole router, whatever the number of ingress replicas)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "Amounts": "amounts",
    "FairShare": "fair",
    "KeyRing": "keys",
    "LeaseShares": "shares",
    "OVER_SHARE_HEADROOM": "fair",
    "Promise": "promises",
    "TenantBook": "book",
    "TenantFacts": "messages",
    "TenantPart": "messages",
    "TenantTally": "tally",
    "budget_error": "rules",
    "ratelimit_headers": "rules",
    "refilled": "rules",
    "render_classes": "tally",
    "render_tenants": "tally",
    "request_cost": "amounts",
}
__all__ = [
    "Amounts", "FairShare", "KeyRing", "LeaseShares", "OVER_SHARE_HEADROOM", "Promise", "TenantBook",
    "TenantFacts", "TenantPart", "TenantTally", "budget_error", "ratelimit_headers", "refilled", "render_classes",
    "render_tenants", "request_cost",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.tenants.amounts import Amounts as Amounts
    from narwhal_serve.tenants.fair import FairShare as FairShare
    from narwhal_serve.tenants.keys import KeyRing as KeyRing
    from narwhal_serve.tenants.shares import LeaseShares as LeaseShares
    from narwhal_serve.tenants.fair import OVER_SHARE_HEADROOM as OVER_SHARE_HEADROOM
    from narwhal_serve.tenants.promises import Promise as Promise
    from narwhal_serve.tenants.book import TenantBook as TenantBook
    from narwhal_serve.tenants.messages import TenantFacts as TenantFacts
    from narwhal_serve.tenants.messages import TenantPart as TenantPart
    from narwhal_serve.tenants.tally import TenantTally as TenantTally
    from narwhal_serve.tenants.rules import budget_error as budget_error
    from narwhal_serve.tenants.rules import ratelimit_headers as ratelimit_headers
    from narwhal_serve.tenants.rules import refilled as refilled
    from narwhal_serve.tenants.tally import render_classes as render_classes
    from narwhal_serve.tenants.tally import render_tenants as render_tenants
    from narwhal_serve.tenants.amounts import request_cost as request_cost
