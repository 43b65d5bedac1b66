"""Operator mistakes the config models accepted and that broke or misbehaved at run time (from a
review): each is now a start-up ValidationError naming the field; each test failed before its fix."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from narwhal_serve.config import NarwhalConfig, format_validation_error

DIGEST = "ab" * 32


def _rejected(args: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as exc:
        NarwhalConfig.model_validate(args)
    assert needle in format_validation_error(exc.value)


# --- engines[].url ---------------------------------------------------------------------------------
# Every engine request is `engine.base_url + PATHS[...]` (engines/legs.py:55, scheduler/monitor.py:29):
#  * no scheme: httpx raises UnsupportedProtocol (an HTTPError) on every scrape -> the engine is just
#    "unhealthy" forever, no start-up error;
#  * ".../v1" (the OpenAI SDK's base_url convention): /v1/v1/chat/completions and /v1/health -> 404;
#    for dialect openai a 404 on /health counts as up (monitor.py NO_ROUTE), so every request 404s;
#  * a query string: "http://h:8000/?k=v" + "/health" puts the path inside the query.
@pytest.mark.parametrize("url", ["localhost:8000", "10.0.0.5:8000", "http://h:8000/v1", "http://h:8000/?k=v"])
def test_engine_url_must_be_an_http_base_url(url: str) -> None:
    _rejected({"engines": [{"name": "a", "url": url, "dialect": "openai"}]}, "engines.0")


# --- P/D routes ------------------------------------------------------------------------------------
# placement/order.py:111 and picker.py:58: P/D dialects exclude `openai` (engines/openai.py: "no P/D"),
# so a prefill/decode engine of the openai dialect is never part of any route: silently unused.
def test_pd_role_with_openai_dialect_is_refused() -> None:
    _rejected({"engines": [
        {"name": "p", "url": "http://h:8000", "role": "prefill", "dialect": "openai"},
        {"name": "d", "url": "http://h:8001", "role": "decode", "dialect": "openai"},
    ]}, "openai")


# engines/sglang.py:34 sends `bootstrap_port` to the SGLang engines as is (0 silently becomes the
# default through `or`); a port outside 1..65535 only fails in the engine, per request.
@pytest.mark.parametrize("port", [70000, -1, 0])
def test_bootstrap_port_must_be_a_port(port: int) -> None:
    _rejected({"engines": [{"name": "p", "url": "http://h:8000", "role": "prefill", "dialect": "sglang",
                            "bootstrap_port": port},
                           {"name": "d", "url": "http://h:8001", "role": "decode", "dialect": "sglang"}]},
              "bootstrap_port")


# kvevents/subscriber.py:68 `sub.connect(self.endpoint)`: zmq refuses an endpoint without a transport
# ("Invalid argument"); follow_forever (subscriber.py:37) logs and retries forever, while the engine's
# prefix index is taken as exact (kvfeeds.py exact_index) and stays empty: prefix routing silently lost.
@pytest.mark.parametrize("endpoint", ["127.0.0.1:5557", ""])
def test_kv_events_endpoint_needs_a_zmq_transport(endpoint: str) -> None:
    _rejected({"engines": [{"name": "a", "url": "http://h:8000", "kv_events": {"endpoint": endpoint}}]},
              "kv_events")


# --- the embedded simulated fleet ------------------------------------------------------------------
# NarwhalConfig._check only checks `engines` names; resolved_engines() turns sim.engines into the fleet
# and scheduler/managed.py:26-29 keys it by name: the second "x" silently replaces the first (two
# servers started by deployments/simfleet.py, one routed to).
def test_sim_engine_names_must_be_unique() -> None:
    _rejected({"sim": {"engines": [{"name": "x"}, {"name": "x"}]}}, "sim")


# deployments/simfleet.py: one server per engine on base_port + i; with the default 3 engines,
# base_port 65535 yields ports 65536 and 65537, which fail only when the SimFleet replica starts.
def test_sim_ports_must_fit_below_65536() -> None:
    _rejected({"sim": {"base_port": 65535}}, "sim.base_port")


# --- monitoring ------------------------------------------------------------------------------------
# placement/engines.py:69 an engine is fresh for stale_after_s after its last scrape, and
# scheduler/service.py:73 scrapes every scrape_interval_s: with scrape_interval_s 10 (stale_after_s 5
# by default) every engine is stale, hence ineligible, half the time, and scheduler/ha.py:175 turns
# the router monitoring_degraded (503 to everyone) in every gap.
def test_stale_after_must_exceed_the_scrape_interval() -> None:
    _rejected({"monitoring": {"scrape_interval_s": 10}}, "stale_after_s")


# docs/configuration.md: "`monitoring.backpressure_s` ... or this long (at most 10 s)", but the model
# takes 30 and placement/health.py:55 silently caps it to BACKPRESSURE_CAP_S.
def test_backpressure_s_over_its_documented_cap_is_refused() -> None:
    _rejected({"monitoring": {"backpressure_s": 30}}, "monitoring.backpressure_s")


# --- admission -------------------------------------------------------------------------------------
# The TTFT pair is checked (ttft_budget_s <= max_ttft_budget_s), the TPOT pair is not:
# gateway/completion.py:152-156 a request without X-TPOT-Target gets tpot_budget_s (20) while one
# asking for 15 is capped at max_tpot_budget_s (10): the default is looser than any explicit target.
def test_tpot_budget_must_not_exceed_its_cap() -> None:
    _rejected({"admission": {"tpot_budget_s": 20}}, "tpot_budget_s")


# --- placement -------------------------------------------------------------------------------------
# placement/drift.py:77 an engine leaves rotation past drift_out_at; :112 it comes back after
# drift_probes profiles within drift_back_at, its score reset to 0. With drift_back_at >= drift_out_at
# an engine that drifts (e.g. +150 %) comes back and is taken out again, flapping forever.
def test_drift_back_must_be_below_drift_out() -> None:
    _rejected({"placement": {"drift_back_at": 2.0}}, "drift_back_at")


# --- tenants / keys --------------------------------------------------------------------------------
# tenants/keys.py:130-133 the last matching digest wins: a key pasted into two tenants silently
# belongs to the later one (its budgets, class ceiling and metrics).
def test_a_key_digest_in_two_tenants_is_refused() -> None:
    _rejected({"tenants": {"list": [{"name": "a", "key_sha256": [DIGEST]},
                                    {"name": "b", "key_sha256": [DIGEST.upper()]}]}}, "key_sha256")


# tenants/keys.py:127 the presented key is `given[7:].strip()`: an empty (or blank) configured key is
# either a blank password or, with header whitespace stripped, a key nobody can present.
@pytest.mark.parametrize("key", ["", "  "])
def test_blank_api_key_is_refused(key: str) -> None:
    _rejected({"serving": {"api_keys": ["real-key", key]}}, "serving.api_keys")


# weight has only gt=0, so YAML `.inf` passes; tenants/fair.py:60-63 then gives that tenant a fair
# share of inf/inf = NaN (every other tenant 0: always "over"), and scheduler/snapshot.py:33 puts the
# NaN into /status, which Starlette's JSONResponse (allow_nan=False) cannot render: /status -> 500.
def test_infinite_tenant_weight_is_refused() -> None:
    from narwhal_serve.tenants.fair import FairShare

    fair = FairShare(weights={"a": math.inf, "b": 1.0})
    fair.admitted("a", 10_000, 1.0)
    fair.admitted("b", 10_000, 1.0)
    assert math.isnan(fair.shares(1.0)["a"][1])  # what an accepted .inf leads to
    _rejected({"tenants": {"list": [{"name": "a", "weight": math.inf}, {"name": "b"}]}}, "weight")


# --- ha --------------------------------------------------------------------------------------------
# LeaseConfig._check validates `url` only with backend redis; `ha: {lease: {url: redis://...}}`
# without `backend: redis` is accepted and runs with no lease (backend none): two routers configured
# this way are both active (split brain), with no warning.
def test_lease_url_without_the_redis_backend_is_refused() -> None:
    _rejected({"ha": {"lease": {"url": "redis://10.0.0.1:6379/0"}}}, "ha.lease")
