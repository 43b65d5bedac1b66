"""Tenants (docs/contract.md, "Tenants"): who sent a request (an API key's tenant) and what it may still use
(per-tenant budgets that hold for the whole router, whatever the number of ingress replicas)."""
