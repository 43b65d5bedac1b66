"""An engine whose circuit breaker opens mid-answer (docs/contract.md, "Mid-stream resume"): the
answers streaming from it that can be resumed exactly are cut at once and continued on another
engine (reason ``breaker_open``, no fault of their own reported); the others go on where they are;
and the ingress cuts for each trip once, as its lease views announce it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from narwhal_serve.admission.view import FleetView
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.relay.pipeline import Relay
from tests.support.relay import faults_of, health_order
from tests.unit.core.test_resume import CONT, E2, FIRST_TWO, chat_tok, events, ids_of, placed, sse

WHY = "its circuit breaker opened"


class Held(httpx.AsyncByteStream):
    """e1's answer: two tokens, then nothing until ``go`` (then the rest, as an engine that was
    only slow would); ``waiting`` is set once it holds."""

    def __init__(self) -> None:
        self.waiting, self.go = asyncio.Event(), asyncio.Event()

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield FIRST_TWO
        self.waiting.set()
        await self.go.wait()
        yield sse(chat_tok("c", 3), chat_tok("d", 4), chat_tok("e", 5, "length"))


class Fleet:
    def __init__(self) -> None:
        self.e1 = Held()
        self.hosts: list[str] = []

    def __call__(self, r: httpx.Request) -> httpx.Response:
        self.hosts.append(r.url.host)
        if r.url.host == "e1":
            return httpx.Response(200, stream=self.e1)
        return CONT(json.loads(r.content))


async def relayed(fleet: Fleet, relay: Relay, p: Any, cut: Any) -> list[RelayMessage]:
    """The relay's messages for ``p``, with ``cut(relay)`` run once e1 holds after two tokens (so the
    cut lands while the relay waits on e1's read)."""
    async def cutter() -> None:
        await fleet.e1.waiting.wait()
        await asyncio.sleep(0.01)  # the relay is inside its read of e1 now
        cut(relay)

    task = asyncio.ensure_future(cutter())
    async with asyncio.timeout(5):  # the idle timeout is 60 s: only the cut can end e1's read
        msgs = [m async for m in relay.run(p)]
    await task
    return msgs


async def test_an_answer_on_an_engine_whose_breaker_opens_is_resumed_at_once_without_a_fault_of_its_own() -> None:
    fleet, counts = Fleet(), []
    async with httpx.AsyncClient(transport=httpx.MockTransport(fleet)) as client:
        relay = Relay(client, idle_timeout_s=60)
        relay.live_targets = lambda _tokens: [E2]
        msgs = await relayed(fleet, relay, placed(return_token_ids=True, temperature=0),
                             lambda r: counts.append(r.cut_engine("e1", WHY)))
    assert counts == [1] and fleet.hosts == ["e1", "e2"]
    evs = events(msgs)
    assert ids_of(evs) == [1, 2, 3, 4, 5] and evs[-1] == "[DONE]" and msgs[-1].error is None
    assert [r for m in msgs for r in m.resumes] == [("breaker_open", "resumed")]
    assert not [f for m in msgs for f in faults_of(m)]  # e1's breaker is open already: the cut is no new fault
    assert health_order(msgs) == [("e1",), ("e2",)]
    assert msgs[-1].stats is not None and msgs[-1].stats.resumed_from == ("e1",)
    assert not relay._active  # nothing left listed


async def test_a_non_streaming_answer_is_assembled_from_both_engines() -> None:
    fleet = Fleet()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fleet)) as client:
        relay = Relay(client, idle_timeout_s=60)
        msgs = await relayed(fleet, relay, placed(stream=False, temperature=0), lambda r: r.cut_engine("e1", WHY))
    body = json.loads(msgs[-1].data)
    assert body["choices"][0]["message"]["content"] == "abcde" and fleet.hosts == ["e1", "e2"]
    assert [r for m in msgs for r in m.resumes] == [("breaker_open", "resumed")]


async def test_an_answer_that_cannot_be_resumed_exactly_stays_on_its_engine_and_finishes_there() -> None:
    fleet, counts = Fleet(), []

    def cut(relay: Relay) -> None:
        counts.append(relay.cut_engine("e1", WHY))
        fleet.e1.go.set()  # e1 was only slow

    async with httpx.AsyncClient(transport=httpx.MockTransport(fleet)) as client:
        relay = Relay(client, idle_timeout_s=60)
        msgs = await relayed(fleet, relay, placed(return_token_ids=True, presence_penalty=0.5), cut)
    assert counts == [0] and fleet.hosts == ["e1"]
    assert ids_of(events(msgs)) == [1, 2, 3, 4, 5] and msgs[-1].error is None
    assert not [r for m in msgs for r in m.resumes]


async def test_answers_on_other_engines_and_answers_with_nowhere_to_go_are_left_alone() -> None:
    for name, live, candidates in (("e2", [E2], True), ("e1", [], False)):
        fleet, counts = Fleet(), []

        def cut(relay: Relay) -> None:
            counts.append(relay.cut_engine(name, WHY))
            fleet.e1.go.set()

        p = placed(return_token_ids=True)
        if not candidates:  # e1 is the only route and nothing else is eligible
            from dataclasses import replace
            p = replace(p, candidates=p.candidates[:1])
        async with httpx.AsyncClient(transport=httpx.MockTransport(fleet)) as client:
            relay = Relay(client, idle_timeout_s=60)
            relay.live_targets = lambda _tokens: live
            msgs = await relayed(fleet, relay, p, cut)
        assert counts == [0] and fleet.hosts == ["e1"] and ids_of(events(msgs)) == [1, 2, 3, 4, 5], name


class _Relay:
    def __init__(self) -> None:
        self.cuts: list[str] = []

    def cut_engine(self, name: str, why: str) -> int:
        self.cuts.append(name)
        return 0


async def test_the_ingress_cuts_once_per_trip_its_views_announce() -> None:
    from types import SimpleNamespace

    from narwhal_serve.gateway.completion import CompletionHandler
    from tests.support.scheduler import scheduler_service

    svc, _ = scheduler_service({"mode": "open"})
    relay = _Relay()
    handler = CompletionHandler(svc.cfg, SimpleNamespace(local_relay=relay), None)  # type: ignore[arg-type]
    view = FleetView(engines=(), unavailable=None, predictive=False)
    handler.on_view(view)
    handler.on_view(FleetView(engines=(), unavailable=None, predictive=False, tripped=(("u", 5.0),)))
    handler.on_view(FleetView(engines=(), unavailable=None, predictive=False, tripped=(("u", 5.0),)))  # the same trip
    handler.on_view(FleetView(engines=(), unavailable=None, predictive=False,
                              tripped=(("u", 5.0), ("d", 6.0))))
    handler.on_view(view)  # closed again
    handler.on_view(FleetView(engines=(), unavailable=None, predictive=False, tripped=(("u", 9.0),)))  # tripped anew
    assert relay.cuts == ["u", "d", "u"]
