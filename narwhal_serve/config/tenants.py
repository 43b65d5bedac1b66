"""Tenants (docs/contract.md, "Tenants"): API keys, hashed, and budgets per tenant."""

from __future__ import annotations

from pydantic import Field, model_validator

from narwhal_serve.config.base import Strict as _Strict


class TenantSpec(_Strict):
    """One tenant (docs/contract.md, "Tenants"): its API keys, hashed, and its budgets (None: unlimited)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # SHA-256 hex digests of its keys (`printf %s "$KEY" | sha256sum`): keys are never configured in clear
    key_sha256: tuple[str, ...] = ()
    # (at least 1: a bucket that never holds a whole request, or token, admits nothing)
    requests_per_minute: float | None = Field(None, ge=1)
    input_tokens_per_minute: float | None = Field(None, ge=1)  # prompt tokens, as the router counts them
    output_tokens_per_minute: float | None = Field(None, ge=1)  # validated output token IDs
    max_concurrent: int | None = Field(None, gt=0)
    # its weight in the fair share of the fleet under overload (docs/contract.md, "Tenants")
    weight: float = Field(1.0, gt=0)
    # its requests' class without X-Priority (None: admission.default_class), and the highest class
    # it may ask for (None: any); a higher X-Priority is lowered to this ceiling
    default_class: str | None = None
    max_class: str | None = None

    @model_validator(mode="after")
    def _digests(self) -> "TenantSpec":
        for d in self.key_sha256:
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d.lower()):
                raise ValueError(f"tenant {self.name!r}: key_sha256 entries are SHA-256 hex digests (64 hex digits)")
        return self

    def limit(self, kind: str) -> float | None:
        """The budget of one kind (``tenants.amounts.KINDS``): per minute, or concurrent requests."""
        if kind == "requests":
            return self.requests_per_minute
        if kind == "input_tokens":
            return self.input_tokens_per_minute
        if kind == "output_tokens":
            return self.output_tokens_per_minute
        return None if self.max_concurrent is None else float(self.max_concurrent)

    def budgeted(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.input_tokens_per_minute,
                                           self.output_tokens_per_minute, self.max_concurrent))


class TenantsConfig(_Strict):
    """Who may send requests, and what each may use. Absent: one anonymous tenant, no key needed
    (or ``serving.api_keys``, the flat set of keys of before)."""

    list: tuple[TenantSpec, ...] = ()
    # More keys, one per line: `<tenant> <sha256 hex digest>` (# comments); re-read when it changes,
    # without a restart
    keys_file: str | None = None
    keys_reload_s: float = Field(1.0, gt=0)  # how often the file's modification time is checked
    # The tenant of requests that present no key (a public tier); None: a key is required. A key
    # that is presented and unknown is refused either way.
    anonymous: str | None = None

    @model_validator(mode="after")
    def _unique(self) -> "TenantsConfig":
        names = [t.name for t in self.list]
        if len(set(names)) != len(names):
            raise ValueError(f"tenants.list: names must be unique; repeated: {sorted({n for n in names if names.count(n) > 1})}")
        if not names:
            raise ValueError("tenants.list: at least one tenant (omit the tenants section for none)")
        if "other" in names:  # tenants/tally.py OTHER: its series would be counted twice on /metrics
            raise ValueError("tenants.list: the name 'other' is reserved (the label of requests of no configured tenant)")
        digests = [d.lower() for t in self.list for d in t.key_sha256]
        if len(set(digests)) != len(digests):  # (the last match won: the key silently another tenant's)
            raise ValueError("tenants.list[].key_sha256: a key belongs to one tenant; a digest is given more than once")
        if self.anonymous is not None and self.anonymous not in names:
            raise ValueError(f"tenants.anonymous {self.anonymous!r} is not in tenants.list")
        return self

    def by_name(self) -> dict[str, TenantSpec]:
        """The configured tenants by name (callers keep it: each call builds it)."""
        return {t.name: t for t in self.list}
