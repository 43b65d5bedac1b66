"""What the gateway reads from a request about its tenant (docs/contract.md, "Tenants", "Priority classes"):
who sent it (the API key), its class (``X-Priority``, within the tenant's default and ceiling), how a
retry of it is recognised, and the rate-limit headers of its answer."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from fastapi import Request

from narwhal_serve.config import AdmissionConfig, NarwhalConfig
from narwhal_serve.config.tenants import TenantSpec
from narwhal_serve.errors import InvalidApiKey, InvalidRequest
from narwhal_serve.gateway.body import header
from narwhal_serve.tenants.amounts import Amounts
from narwhal_serve.tenants.keys import KeyRing
from narwhal_serve.tenants.rules import ratelimit_headers, refilled
from narwhal_serve.tenants.tally import TenantTally


def fingerprint(tenant: str, raw: bytes) -> str:
    """A retrying client's request, recognised again: an SDK retry resends the same body."""
    return hashlib.blake2b(raw, digest_size=12, key=tenant.encode()[:64]).hexdigest()


class Tenancy:
    def __init__(self, cfg: NarwhalConfig, mono: Callable[[], float]) -> None:
        self.admission = cfg.admission
        self.keys = KeyRing(cfg.tenants, cfg.serving.api_keys, mono=mono)
        self.specs = cfg.tenants.by_name() if cfg.tenants is not None else {}
        self.labels = TenantTally(tuple(self.specs), tuple(c.name for c in cfg.admission.classes))
        self.mono = mono
        # each tenant's remaining budget as the scheduler last said it, and when (without admission
        # leases, what an answer that got no word of it shows)
        self.heard: dict[str, tuple[Amounts, float]] = {}

    def identify(self, request: Request) -> str:
        """The request's tenant; 401 ``invalid_api_key`` for a missing or unknown key where keys are
        required.  The key itself is never logged."""
        tenant = self.keys.identify(header(request, "authorization"))
        if tenant is None:
            raise InvalidApiKey("Incorrect or missing API key: send 'Authorization: Bearer <key>'.")
        return tenant

    def slots_counted(self, tenant: str) -> bool:
        """The tenant has a ``max_concurrent``: its slots are counted at the scheduler (gateway/admit.py)."""
        spec = self.specs.get(tenant)
        return spec is not None and spec.max_concurrent is not None

    def label(self, tenant: str) -> str | None:
        """Its tenant's label in counters and the request log (None: no tenants configured)."""
        return self.labels.label(tenant)

    def priority(self, request: Request, tenant: str) -> tuple[int, float | None]:
        """(class rank, admit-within seconds) from ``X-Priority``, the tenant's default class when
        absent, lowered to the tenant's ceiling."""
        return class_of(self.admission, self.specs.get(tenant), header(request, "x-priority"))

    def class_name(self, rank: int) -> str | None:
        return self.labels.class_label(rank)

    def fingerprint(self, tenant: str, raw: bytes, retries: int | None) -> str:
        """The request's fingerprint when its client retries (it says so) and its tenant has a
        budget (a refusal then keeps a promise for it, found again by this); else ``""``."""
        spec = self.specs.get(tenant)
        return fingerprint(tenant, raw) if retries is not None and spec is not None and spec.budgeted() else ""

    def limits(self, tenant: str, remaining: Amounts | None) -> dict[str, str]:
        """OpenAI's rate-limit headers for an answer to a budgeted tenant: the router's remaining
        budget as this replica heard it now, else as it last heard it, refilled since."""
        spec = self.specs.get(tenant)
        if spec is None or not spec.budgeted():
            return {}
        now = self.mono()
        if remaining is not None:
            self.heard[tenant] = (remaining, now)
        elif (last := self.heard.get(tenant)) is not None:
            remaining = refilled(spec, last[0], now - last[1])
        return dict(ratelimit_headers(spec, remaining)) if remaining is not None else {}


def class_of(adm: AdmissionConfig, spec: TenantSpec | None, given: str | None) -> tuple[int, float | None]:
    """(class rank, admit-within seconds) of a request asking for class ``given`` (``X-Priority``;
    None: its tenant's default class, else ``admission.default_class``), lowered to its tenant's
    ceiling; 400 naming the header for a class not configured.  (The trace replay's too.)"""
    if given is None:
        rank = adm.class_rank((spec.default_class if spec is not None else None) or adm.default_class)
    else:
        rank = adm.class_rank(given.strip().lower())
        if rank is None:
            raise InvalidRequest(f"header X-Priority must be one of {[c.name for c in adm.classes]}",
                                 param="x-priority")
    assert rank is not None
    if spec is not None and spec.max_class is not None:
        rank = max(rank, adm.class_rank(spec.max_class) or 0)  # a higher class than allowed: its ceiling
    share = adm.classes[rank].ttft_share
    return rank, (share * adm.ttft_budget_s if share < 1.0 else None)
