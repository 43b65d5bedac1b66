"""A prompt the fleet cannot hold (admission/core.py): counted exactly, a prompt that leaves no
engine room for an output token is a 400 ``context_length_exceeded`` before any TTFT judgement (it
used to be a 429 ``prompt_exceeds_ttft_budget``, or the engine's own 400 after admission); in a
fleet of mixed context lengths it is placed only where it fits.  Each engine's context comes from
its ``/v1/models`` (scheduler/monitor.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx

from narwhal_serve.admission.core import Ask, FleetView, decide
from narwhal_serve.config import EngineConfig
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.scheduler.monitor import context_of, scrape_one
from tests.unit.admission.test_overload_decisions import NOW, engine, placed, refused, view


def test_an_exact_prompt_no_engine_can_hold_is_a_400_before_the_ttft_judgement() -> None:
    v = view(engine("a", context=4096), engine("b", context=4096))
    for kind, param in (("chat", "messages"), ("completion", "prompt")):
        out = refused(v, Ask(4096, 30.0, kind=kind, exact=True))
        assert out.outcome is Outcome.INVALID
        assert (out.error.status, out.error.code, out.error.param) == (400, "context_length_exceeded", param)
        assert "maximum context length is 4096 tokens" in out.error.message and "4096 tokens" in out.error.message
        assert out.error.retry_after is None
    # one token of room is enough (vLLM serves it); a tight TTFT budget is judged as before
    assert placed(v, Ask(4095, 30.0, exact=True)).engines
    assert refused(v, Ask(4096, 0.001, exact=True)).error.code == "context_length_exceeded"
    assert refused(v, Ask(4000, 0.001, exact=True)).error.code == "prompt_exceeds_ttft_budget"


def test_an_estimated_prompt_or_an_engine_of_unknown_context_is_not_refused_for_it() -> None:
    """The estimate is not the engine's count, and an engine that did not say its context may
    take it: the engine decides then."""
    assert placed(view(engine("a", context=4096)), Ask(5000, 30.0)).engines == ("a",)
    assert placed(view(engine("a", context=4096), engine("b")), Ask(5000, 30.0, exact=True)).engines


def test_in_a_fleet_of_mixed_contexts_a_long_prompt_goes_where_it_fits() -> None:
    small = [engine(f"s{i}", context=2048) for i in range(10)]  # idle, but too short for it
    big = engine("big", context=32768, inflight=5)
    v = view(*small, big)
    p = placed(v, Ask(3000, 30.0, exact=True))
    assert [r.decode.name for r in p.routes] == ["big"]
    p = placed(v, Ask(1000, 30.0, exact=True))
    assert "big" not in p.engines  # a short prompt still goes to the least loaded
    open_mode = replace(v, predictive=False)
    assert [r.decode.name for r in decide(open_mode, Ask(3000, 30.0, exact=True), NOW, 0).routes] == ["big"]  # type: ignore[union-attr]


def test_the_fleet_context_follows_an_engine_restarted_with_another() -> None:
    a, b = engine("a", context=4096), engine("b", context=4096)
    v = view(a, b)
    assert v.context() == (4096, 4096)
    delta = FleetView(engines=(replace(b, context=16384),), unavailable=None, predictive=True)
    merged = v.merged(delta, ())
    assert merged is not None and merged.context() == (4096, 16384)
    assert placed(merged, Ask(8000, 30.0, exact=True)).engines == ("b",)
    same = merged.merged(FleetView(engines=(replace(a, inflight=3),), unavailable=None, predictive=True), ())
    assert same is not None and same.context() == (4096, 16384)


def test_context_of_reads_the_model_cards_max_model_len() -> None:
    card = {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096},
                                       {"id": "lora", "object": "model", "max_model_len": 4096}]}
    assert context_of(card) == 4096
    for said in ({"data": [{"id": "m"}]}, {"data": [{"max_model_len": True}]}, {"data": "x"}, None, [],
                 {"data": [{"max_model_len": -1}]}):
        assert context_of(said) == 0


async def test_the_scrape_asks_each_engine_for_its_context_once_each_time_it_comes_up() -> None:
    asked: list[str] = []
    state: dict[str, object] = {"up": True, "models": 200, "len": 2048}

    def answer(r: httpx.Request) -> httpx.Response:
        asked.append(r.url.path)
        if not state["up"]:
            raise httpx.ConnectError("refused")
        if r.url.path == "/v1/models":
            if state["models"] == "reset":
                raise httpx.ReadError("reset")
            if state["models"] != 200:
                return httpx.Response(int(str(state["models"])))
            return httpx.Response(200, content=json.dumps({"data": [{"id": "m", "max_model_len": state["len"]}]}))
        return httpx.Response(200, text="")

    e = EngineState(EngineConfig(name="e", url="http://e"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await scrape_one(client, e, 1.0, 1.0)
        assert e.healthy and e.context == 2048
        await scrape_one(client, e, 2.0, 1.0)
        assert asked.count("/v1/models") == 1
        state["up"] = False
        await scrape_one(client, e, 3.0, 1.0)
        assert not e.healthy and e.context == 2048  # kept while it is down
        state.update(up=True, models="reset")  # back; its model cards do not answer this time
        await scrape_one(client, e, 4.0, 1.0)
        assert e.healthy and e.context == 2048 and asked.count("/v1/models") == 2
        state.update(models=200, len=8192)  # asked again at the next scrape: restarted with another
        await scrape_one(client, e, 5.0, 1.0)
        assert e.context == 8192 and asked.count("/v1/models") == 3
        state["up"] = False
        await scrape_one(client, e, 6.0, 1.0)
        state.update(up=True, models=404)  # back, as a server without model cards
        await scrape_one(client, e, 7.0, 1.0)
        assert e.healthy and e.context == 0
        await scrape_one(client, e, 8.0, 1.0)
        assert asked.count("/v1/models") == 4
