"""The Grafana dashboard (``deploy/grafana/narwhal.json``) against a real Prometheus (docs/operations.md, "Dashboard").

A private Prometheus (``scripts/prometheus_server.py``: Debian's 2.42 package, installed by ``make
test``) scrapes the running graph's /metrics every 500 ms while a mixed load runs (completions and
chats, streamed or not, plus refusals over the TTFT budget and invalid requests). Then every query
of every panel, and every template variable, is evaluated through Prometheus's HTTP API with
Grafana's variables substituted: each must return data (no dead panel), and every metric the
dashboard names must be one the router exports. Without a ``prometheus`` binary the test fails
under CI (``CI`` set) and is skipped elsewhere, saying how to install it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts import prometheus_server
from scripts.prometheus_server import PrometheusServer
from tests.integration.conftest import MODEL, SIM_ENGINES, Graph
from tests.integration.helpers import chat_body, status, wait_status

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "narwhal.json"
JOB = "narwhal"
# Grafana's variables, as the test evaluates them: windows long enough to cover the whole load
# (Prometheus starts just before it), every engine.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "15s", "$job": JOB, "$engine": ".*", "$tenant": ".*"}
METRIC = re.compile(r"\bnarwhal_[a-z0-9_]+")
LABEL_VALUES = re.compile(r"^label_values\((?P<match>.+),\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\)$")


# -- the dashboard as data ---------------------------------------------------------------------
def load() -> dict[str, Any]:
    out: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return out


def all_panels(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def queries(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every panel target."""
    return [(p["title"], t["refId"], t["expr"]) for p in all_panels(d) for t in p.get("targets", [])]


def variable_queries(d: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((v["name"], q))
    return out


def substitute(expr: str) -> str:
    for k in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(k, GRAFANA_VARS[k])
    assert "$" not in expr, f"an unsubstituted Grafana variable in: {expr}"
    return expr


def exported_names(text: str) -> set[str]:
    """Sample names in the exposition, and those of every declared family (a labelled counter is
    declared before its first sample: ``narwhal_expired_total`` before any request expired)."""
    names = {ln.split("{", 1)[0].split(" ", 1)[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    for ln in text.splitlines():
        if ln.startswith("# TYPE "):
            _, _, name, kind = ln.split(" ", 3)
            names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


def test_dashboard_imports_as_is() -> None:
    d = load()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"] and d.get("id") is None
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert "__inputs" not in d  # nothing to resolve at import: the data source is a variable
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids))
    ref = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == ref
    for p in all_panels(d):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == ref and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ref and t["expr"].strip(), (p["title"], t["refId"])
    titles = " | ".join(p["title"] for p in all_panels(d)).lower()
    for what in ("outcomes by reason", "offered vs admitted vs goodput", "ttft percentiles", "tpot percentiles",
                 "predicted vs measured ttft", "queue", "in flight", "eligibility", "drift", "running / waiting"):
        assert what in titles, what


# -- against Prometheus ------------------------------------------------------------------------
def prometheus_or_skip() -> str:
    binary = prometheus_server.find_binary()
    if binary is None:
        msg = ("no prometheus binary: run `.venv/bin/python scripts/prometheus_server.py install` "
               "(make test does; Debian's `prometheus` package)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return binary


async def until(what: str, probe: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll ``probe`` (a blocking call, run in a thread) until it returns something truthy (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        got = await asyncio.to_thread(probe)
        if got:
            return got
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def scalar(prom: PrometheusServer, expr: str) -> float | None:
    res = prom.query(expr)["result"]
    return float(res[0]["value"][1]) if res else None


async def one_wave(c: httpx.AsyncClient, i: int) -> list[int]:
    """Successes (chat and completions, streamed or not), one refusal over the TTFT budget, one
    invalid request; the status of each."""

    async def post(path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> int:
        if body.get("stream"):
            async with c.stream("POST", path, json=body, headers=headers or {}) as r:
                await r.aread()
                return r.status_code
        return (await c.post(path, json=body, headers=headers or {})).status_code

    comp = {"model": MODEL, "prompt": f"narwhals {i} " * (1 + i % 7), "max_tokens": 6}
    return list(await asyncio.gather(
        post("/v1/chat/completions", chat_body(f"hello {i}", max_tokens=6)),
        post("/v1/chat/completions", chat_body(f"stream {i} " * (1 + i % 5), stream=True, max_tokens=8)),
        post("/v1/completions", comp),
        post("/v1/completions", {**comp, "stream": True}),
        post("/v1/chat/completions", chat_body("long " * 2000), {"X-TTFT-Target": "0.0001"}),
        post("/v1/chat/completions", {**chat_body("x"), "model": "no-such-model"}),
    ))


async def test_every_dashboard_query_returns_data(graph: Graph) -> None:
    binary = prometheus_or_skip()
    d = load()
    prom = PrometheusServer([graph.url.removeprefix("http://")], job=JOB, interval="500ms", binary=binary)
    await asyncio.to_thread(prom.start)
    try:
        await run_against(graph, prom, d)
    finally:
        await asyncio.to_thread(prom.stop)


async def run_against(graph: Graph, prom: PrometheusServer, d: dict[str, Any]) -> None:
    up = f'up{{job="{JOB}"}}'
    await until("Prometheus's first scrape of /metrics", lambda: scalar(prom, up) == 1.0)
    # Load, until Prometheus has scraped at least 6 times while it ran (bounded by waves).
    before = (await status(graph.url))["counters"]["offered"]
    started = time.time()
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=graph.url, timeout=60) as c:
        for i in range(40):
            statuses += await one_wave(c, i)
            scrapes = await asyncio.to_thread(
                scalar, prom, f"count_over_time({up}[{max(1, math.ceil(time.time() - started))}s])")
            if i >= 3 and (scrapes or 0) >= 6:
                break
    assert statuses.count(200) >= 16 and statuses.count(429) >= 4 and statuses.count(404) >= 4, statuses
    # Every request of the load counted by the scheduler, then in Prometheus.
    snap = await wait_status(graph.url, lambda s: s["counters"]["offered"] >= before + len(statuses),
                             "the load to be counted", timeout=30)
    offered = snap["counters"]["offered"]
    await until("Prometheus to scrape the final counters",
                lambda: (scalar(prom, f'narwhal_offered_total{{job="{JOB}"}}') or 0) >= offered)

    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        exported = exported_names((await c.get("/metrics")).text)
    named = {m for _, _, e in queries(d) for m in METRIC.findall(e)}
    named |= {m for _, q in variable_queries(d) for m in METRIC.findall(q)}
    assert named, "the dashboard names no narwhal metric"
    assert not named - exported, f"the dashboard uses metrics the router does not export: {sorted(named - exported)}"

    dead: list[str] = []
    results: dict[str, list[dict[str, Any]]] = {}
    for title, ref, expr in queries(d):
        try:
            res = (await asyncio.to_thread(prom.query, substitute(expr)))["result"]
        except ValueError as exc:
            dead.append(f"{title} [{ref}]: query error {exc}")
            continue
        results[f"{title}/{ref}"] = res
        values = [float(s["value"][1]) for s in res] if isinstance(res, list) else []
        if not any(math.isfinite(v) for v in values):
            dead.append(f"{title} [{ref}]: {'no series' if not res else 'no finite value'}: {substitute(expr)}")
    for name, q in variable_queries(d):
        m = LABEL_VALUES.match(q.strip())
        assert m is not None, f"variable {name}: not a label_values() query: {q}"
        got = await asyncio.to_thread(prom.label_values, m["label"], substitute(m["match"]))
        if not got:
            dead.append(f"variable {name}: no values for {q}")
        if name == "engine":
            assert {e["name"] for e in SIM_ENGINES} <= set(got), got
    assert not dead, "dashboard queries without data:\n" + "\n".join(dead)

    # The panels show the load: the refusals and invalid requests by their reason, and goodput.
    over_range = results["Outcomes over the time range, by reason/A"]
    seen = {(s["metric"].get("outcome"), s["metric"].get("reason")) for s in over_range if float(s["value"][1]) > 0}
    assert {("refused", "prompt_exceeds_ttft_budget"), ("invalid_requests", "model_not_found"),
            ("completed", "ok")} <= seen, seen
    assert float(results["Offered vs admitted vs goodput/D"][0]["value"][1]) > 0
