"""Differential review of how Narwhal reads engines' Prometheus pages and renders its own, against
the upstream sources (vllm-project/vllm, sgl-project/sglang, prometheus/client_python).  Each test
names the upstream file it was read from; each failed before its fix."""

from __future__ import annotations

import collections
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from narwhal_serve.config import EngineConfig, NarwhalConfig
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.engines.metrics import parse_engine_metrics
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.picker import load_score
from narwhal_serve.scheduler.monitor import scraped
from narwhal_serve.sim.engine import Engine
from narwhal_serve.sim.metrics import render_metrics as render_sim_metrics


def _series(text: str) -> collections.Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every (sample name, label set) on a page, counted (prometheus_client's own parser)."""
    seen: collections.Counter[tuple[str, tuple[tuple[str, str], ...]]] = collections.Counter()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            seen[(s.name, tuple(sorted(s.labels.items())))] += 1
    return seen


# ------------------------------------------------------------------ engines' pages: names by version

def test_vllm_before_0_9_2_kv_cache_usage_is_read() -> None:
    """vLLM 0.6.x .. 0.9.1 publish KV usage only as ``vllm:gpu_cache_usage_perc`` (V0
    vllm/engine/metrics.py; V1 vllm/v1/metrics/loggers.py: "Deprecated in 0.9.2 - Renamed as
    vllm:kv_cache_usage_perc", hidden from 0.11, removed 0.12).  Narwhal reads only the new name:
    such an engine always reads 0 % KV usage, so a full cache never raises its load score."""
    v0 = (
        "# HELP vllm:num_requests_running Number of requests currently running on GPU.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 7.0\n'
        "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.93\n'
    )
    load = parse_engine_metrics(v0)
    assert load.running == 7.0
    assert load.kv_usage == 0.93


def test_sglang_kv_capacity_is_read() -> None:
    """SGLang publishes its KV pool size: ``sglang:max_total_num_tokens`` (its first Prometheus
    support, PR #1853, and again in python/sglang/srt/observability/metrics_collector.py @44cedc2b)
    and ``sglang:cache_config_info{page_size,num_pages}`` (same file).  Narwhal reads capacity only
    from ``vllm:cache_config_info``: an SGLang engine reports 0, and its prefix index is never bounded
    by what the engine's KV cache can hold (service.scrape_once)."""
    page = (
        "# TYPE sglang:max_total_num_tokens gauge\n"
        'sglang:max_total_num_tokens{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",'
        'tp_rank="0"} 570979.0\n'
        "# TYPE sglang:cache_config_info gauge\n"
        'sglang:cache_config_info{num_pages="570979",page_size="1"} 1.0\n'
        'sglang:num_running_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0\n'
    )
    assert parse_engine_metrics(page).kv_tokens == 570979


def test_sglang_decode_engine_waiting_counts_its_pd_queues() -> None:
    """On an SGLang P/D decode engine, requests wait for KV memory in the prealloc queue and for the
    KV itself in the transfer queue (``sglang:num_decode_prealloc_queue_reqs``,
    ``sglang:num_decode_transfer_queue_reqs``; metrics_collector.py @44cedc2b, set in
    scheduler_metrics_mixin.py); ``sglang:num_queue_reqs`` is only ``len(waiting_queue)``.  vLLM counts
    the same waits in ``vllm:num_requests_waiting`` (its by-reason help: "'deferred' = ... KV
    transfer ... Sum of all reasons equals vllm:num_requests_waiting").  Narwhal reads only
    num_queue_reqs: a decode engine with a backlog of 6 looks as if 1 were waiting."""
    lab = 'engine_type="decode",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    page = (
        f"sglang:num_running_reqs{{{lab}}} 32.0\n"
        f"sglang:num_queue_reqs{{{lab}}} 1.0\n"
        f"sglang:num_decode_prealloc_queue_reqs{{{lab}}} 4.0\n"
        f"sglang:num_decode_transfer_queue_reqs{{{lab}}} 2.0\n"
        f"sglang:token_usage{{{lab}}} 0.97\n"
    )
    assert parse_engine_metrics(page).waiting == 7.0


# ------------------------------------------------------------------ engines' pages: label sets

def test_sglang_per_tp_rank_copies_are_not_summed() -> None:
    """With ``--enable-metrics-for-all-schedulers`` every TP rank's scheduler publishes the same
    batch (SGLang: ``current_scheduler_metrics_enabled = attn_tp_rank == 0 or
    enable_metrics_for_all_schedulers``; labels model_name, engine_type, tp_rank, pp_rank,
    moe_ep_rank and, per DP group, dp_rank: scheduler_metrics_mixin.py @44cedc2b).  The copies differ
    only in tp_rank/moe_ep_rank; only DP groups hold different requests.  Narwhal sums every label
    set: 2 DP groups x 2 TP ranks running 5 and 3 read as 16, not 8."""
    lines = []
    for dp, (tps, running, queued) in enumerate((((0, 1), 5, 2), ((2, 3), 3, 1))):
        for tp in tps:
            lab = (f'dp_rank="{dp}",engine_type="unified",model_name="m",moe_ep_rank="{tp}",'
                   f'pp_rank="0",tp_rank="{tp}"')
            lines += [f"sglang:num_running_reqs{{{lab}}} {running}.0",
                      f"sglang:num_queue_reqs{{{lab}}} {queued}.0"]
    load = parse_engine_metrics("\n".join(lines) + "\n")
    assert (load.running, load.waiting) == (8.0, 3.0)


# ------------------------------------------------------------------ engines' pages: exposition syntax

def test_a_sample_timestamp_is_not_read_as_the_value() -> None:
    """The text format is ``name{labels} value [timestamp]`` (prometheus/client_python
    exposition.py ``sample_line`` writes `` {value}{timestamp}``; its parser reads both).  Narwhal
    takes the last field: a page with timestamps (a federating or relabelling proxy in front of the
    engine) reads 1.7e12 requests running."""
    page = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0 1712345678901\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0 1712345678901\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25 1712345678901\n')
    load = parse_engine_metrics(page)
    assert (load.running, load.waiting, load.kv_usage) == (3.0, 1.0, 0.25)


def test_non_finite_engine_gauges_do_not_crash_the_scrape() -> None:
    """``NaN``, ``+Inf`` are valid sample values (client_python ``floatToGoString``).  Narwhal keeps
    them in EngineLoad, then ``scraped()`` does ``int(e.load.running)`` (ValueError/OverflowError):
    the exception leaves ``scrape_all`` and ends ``SchedulerService._monitor_loop`` (no try), so one
    engine's odd page stops every engine's scraping for good.  A waiting of NaN also breaks
    ``EngineState.external()`` (int(nan)) at admission time."""
    e = EngineState(EngineConfig(name="e", url="http://127.0.0.1:9", role="unified"))
    scraped(e, 1000.0, True, 'vllm:num_requests_running{engine="0",model_name="m"} NaN\n'
                             'vllm:num_requests_waiting{engine="0",model_name="m"} +Inf\n')
    assert e.last_ok == 1000.0
    assert math.isfinite(e.load.running) and math.isfinite(e.load.waiting)
    assert e.external() >= 0 and 0.0 <= load_score(e) <= 1.0


# ------------------------------------------------------------------ Narwhal's own /metrics

def test_a_tenant_named_other_is_refused_at_start() -> None:
    """``other`` passed the tenant-name pattern (config/tenants.py ``^[A-Za-z0-9_.-]{1,64}$``) but is
    also the label of requests of no configured tenant (tenants/tally.py ``OTHER``):
    ``TenantTally.view`` listed it twice once anything was counted under it, so every
    ``narwhal_tenant_*`` series of that tenant appeared twice on the page (OpenMetrics forbids it;
    Prometheus drops the repeats).  The name is reserved: a config naming it is refused, in words."""
    with pytest.raises(ValidationError, match="'other' is reserved"):
        NarwhalConfig.model_validate({"tenants": {"list": [{"name": "other"}, {"name": "a"}]}})


def test_sim_page_escapes_its_model_name() -> None:
    """The simulator's page should read as vLLM's (client_python escapes label values: backslash,
    quote, newline).  ``sim/metrics.py`` pastes the configured model name into the label set
    unescaped, and ``_labels`` splits that set on ``,``: a served name with a quote or a comma makes
    a page no Prometheus parser accepts."""
    model = 'team "a", model'
    page = render_sim_metrics(Engine(SimEngineConfig(model=model)))
    seen = _series(page)  # raises on the current page
    running = [k for k in seen if k[0] == "vllm:num_requests_running"]
    assert running and dict(running[0][1])["model_name"] == model
    assert all(dict(k[1]).get("model_name") == model for k in seen if k[0] == "vllm:num_requests_waiting_by_reason")
