"""Priority classes on constructed data: the queue grants by class then arrival, a lower class keeps
headroom for the ones above (refused while its projection passes its share of the top target),
the class reaches engines that schedule by priority and no other."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from narwhal_serve.admission.controller import AdmissionController, Enqueued, Grant, Refusal
from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.config import AdmissionConfig, EngineConfig, NarwhalConfig, PhaseConcurrency, ServingConfig
from narwhal_serve.engines.legs import prioritized
from tests.support.scheduler import scheduler_service


def test_the_queue_grants_the_highest_class_first_and_fifo_within_it() -> None:
    c = AdmissionController(AdmissionConfig(mode="open", queue_limit=10, phase_concurrency=PhaseConcurrency(prefill=1, decode=10)),
                            ServingConfig())
    assert isinstance(c.offer("running", 0.0, 100.0, rank=1), Grant)
    for tid, rank in (("batch-1", 2), ("std-1", 1), ("batch-2", 2), ("inter-1", 0), ("std-2", 1), ("inter-2", 0)):
        assert isinstance(c.offer(tid, 0.0, 100.0, rank=rank), Enqueued)
    c.release("batch-2")  # a queued ticket that leaves keeps the counts right
    order = []
    c.enter_decode("running")
    while c.queue:
        granted, _ = c.pump(1.0)
        assert len(granted) == 1
        order.append(granted[0].id)
        c.enter_decode(granted[0].id)
    assert order == ["inter-1", "inter-2", "std-1", "std-2", "batch-1"]


def test_a_lower_class_is_refused_while_it_would_eat_the_headroom_of_the_classes_above() -> None:
    svc, clock = scheduler_service({"mode": "predictive", "ttft_budget_s": 2.0})
    for e in svc.engines.values():  # over 1 s of prefill already queued at every engine
        e.pending_prefill_tokens = 6000
        e.pending_prefill_requests = 3
    view = svc.view(clock())
    standard = decide(view, Ask(200, 2.0, rank=1), clock(), 0)
    batch = decide(view, Ask(200, 2.0, rank=2, admit_within_s=0.5 * 2.0), clock(), 0)
    assert isinstance(standard, Placement) and standard.predicted_s is not None
    assert 1.0 < standard.predicted_s <= 2.0, standard.predicted_s  # within the target, past the batch share
    assert isinstance(batch, Refusal) and batch.error.code == "ttft_budget_exceeded"
    assert batch.error.retry_after is not None and batch.error.retry_after >= 1
    for e in svc.engines.values():
        e.pending_prefill_tokens, e.pending_prefill_requests = 0, 0
    assert isinstance(decide(svc.view(clock()), Ask(200, 2.0, rank=2, admit_within_s=1.0), clock(), 0), Placement)


def test_priority_reaches_only_engines_that_schedule_by_it() -> None:
    on = EngineConfig(name="a", url="http://x", priority_scheduling=True)
    off = EngineConfig(name="b", url="http://x")
    openai_engine = EngineConfig(name="c", url="http://x", dialect="openai", priority_scheduling=True)
    assert prioritized(on, {"model": "m"}, 2) == {"model": "m", "priority": 2}
    assert prioritized(off, {"model": "m"}, 2) == {"model": "m"}
    assert prioritized(openai_engine, {"model": "m"}, 2) == {"model": "m"}
    assert prioritized(on, {"model": "m"}, None) == {"model": "m"}
    # a client's own priority reaches no engine: replaced by its class's rank, or dropped
    assert prioritized(on, {"model": "m", "priority": -100}, 2) == {"model": "m", "priority": 2}
    for engine, rank in ((off, 2), (openai_engine, 2), (on, None)):
        assert prioritized(engine, {"model": "m", "priority": -100}, rank) == {"model": "m"}


def test_class_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="default_class"):
        AdmissionConfig(default_class="vip")
    with pytest.raises(ValidationError, match="max_class"):
        NarwhalConfig.model_validate({"tenants": {"list": [{"name": "a", "max_class": "vip"}]}})
    assert AdmissionConfig().class_rank("batch") == 2 and AdmissionConfig().class_rank("nope") is None


def test_within_a_class_tenants_over_their_share_wait_behind_the_others() -> None:
    c = AdmissionController(AdmissionConfig(mode="open", queue_limit=10, phase_concurrency=PhaseConcurrency(prefill=1, decode=10)),
                            ServingConfig())
    assert isinstance(c.offer("running", 0.0, 100.0), Grant)
    for tid, tenant, rank in (("a1", "a", 1), ("a2", "a", 1), ("b1", "b", 1), ("a-top", "a", 0), ("b2", "b", 1)):
        assert isinstance(c.offer(tid, 0.0, 100.0, rank=rank, tenant=tenant), Enqueued)
    order = []
    c.enter_decode("running")
    while c.queue:
        granted, _ = c.pump(1.0, over_share=frozenset({"a"}))
        order.append(granted[0].id)
        c.enter_decode(granted[0].id)
    assert order == ["a-top", "b1", "b2", "a1", "a2"]  # class first; then b (within its share), then a
