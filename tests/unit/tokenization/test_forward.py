"""Prompts sent to the engine as the router's own token IDs (tokenization/forward.py): only after
the engine's answers showed the same IDs, never for what the engine must see as text, stopped by
one disagreement; the answer the same either way (the relay over a simulated vLLM engine, which
takes a chat's IDs as vLLM 0.32 does, ``kv_transfer_params.prompt_token_ids``)."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from typing import Any

import httpx
import pytest

from narwhal_serve.errors import UnsupportedOption

from narwhal_serve.config import EngineConfig
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.engines.legs import DIALECTS
from narwhal_serve.engines.vllm import VLLM
from narwhal_serve.protocol.placement import PlacedRequest, RouteChoice
from narwhal_serve.protocol.requests import ParsedRequest, parse_request
from narwhal_serve.relay.pipeline import Relay
from narwhal_serve.sim.app import create_app
from narwhal_serve.sim.tokenizer import SimTokenizer
from narwhal_serve.tokenization.forward import RECHECK_EVERY, TRUST_S, VERIFY_FIRST, PromptIdForwarding, shape_of
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.sse import parse_sse

ENGINE = EngineConfig(name="e1", url="http://sim")


async def sized(route: str, body: dict[str, Any]) -> ParsedRequest:
    raw = json.dumps({"model": "narwhal-sim", **body}).encode()
    return (await PromptSizer(SimTokenizer()).size(parse_request(route, raw, model="narwhal-sim"))).parsed  # type: ignore[arg-type]


def completion(prompt: str = "the quick brown fox jumps", **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True, **extra}


def chat(text: str = "tell me about foxes", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
            "max_tokens": 6, "temperature": 0, "stream": True, **extra}


class Fleet:
    """A relay over one simulated vLLM engine (in process): the bodies it got and the answers."""

    def __init__(self, mode: str = "completions", dialect: str = "vllm") -> None:
        self.app = create_app(SimEngineConfig(name="e1", eos_prob=0, dialect=dialect))  # type: ignore[arg-type]
        self.engine = self.app.state.sim_engine
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app))
        self.relay = Relay(self.client, forward_prompt_ids=mode)  # type: ignore[arg-type]
        self.relay.forwarding._rng = random.Random(3)
        self.engine_cfg = EngineConfig(name="e1", url="http://sim", dialect=dialect)  # type: ignore[arg-type]

    async def ask(self, req: ParsedRequest, rid: str = "rid") -> str:
        placed = PlacedRequest(rid, "narwhal-sim", req, (RouteChoice(kind="single", decode=self.engine_cfg),),
                               time.time() + 30)
        data = b""
        async for msg in self.relay.run(placed):
            assert msg.error is None, msg.error
            data += msg.data
        text = ""
        for ev in parse_sse(data.decode()):
            if isinstance(ev, dict):
                for ch in ev.get("choices") or ():
                    text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
        return text

    def sent(self) -> dict[str, Any]:
        body: dict[str, Any] = self.engine.recent[-1]["body"]
        return body

    async def close(self) -> None:
        await self.client.aclose()


async def test_an_engine_gets_ids_only_after_its_answers_showed_the_routers_own() -> None:
    fleet = Fleet()
    try:
        req = await sized("completion", completion())
        assert req.own_ids is not None
        texts = []
        for i in range(VERIFY_FIRST):
            texts.append(await fleet.ask(req))
            assert fleet.sent()["prompt"] == "the quick brown fox jumps", i  # text until trusted
        sent_as = []
        for _ in range(3):
            texts.append(await fleet.ask(req))
            sent_as.append(fleet.sent()["prompt"])
        assert list(req.own_ids) in sent_as  # now the router's IDs (bar a random recheck)
        assert len(set(texts)) == 1 and texts[0]  # the same answer either way
        row = fleet.relay.forwarding.status()["engines"]["e1"]["completion"]
        assert row["agreed"] + row["forwarded"] == VERIFY_FIRST + 3 and row["disagreed"] == []
    finally:
        await fleet.close()


async def test_rechecks_are_random_and_trust_has_an_age() -> None:
    fwd = PromptIdForwarding("all", random.Random(1))
    req = await sized("completion", completion())
    for _ in range(VERIFY_FIRST):
        fwd.observed("e1", "r", req, list(req.own_ids or ()), now=100.0)
    text = sum(fwd.choose("e1", True, req, now=100.0) is None for _ in range(6400))
    assert 60 <= text <= 140  # about one in RECHECK_EVERY, at random (no period a workload can line up with)
    assert RECHECK_EVERY == 64
    assert fwd.choose("e1", True, req, now=100.0 + TRUST_S + 1) is None  # too long since the last check
    fwd.observed("e1", "r", req, list(req.own_ids or ()), now=100.0 + TRUST_S + 1)
    assert any(fwd.choose("e1", True, req, now=100.0 + TRUST_S + 2) is not None for _ in range(5))
    fwd.forget("e1")  # the engine could not be reached: it starts over
    assert all(fwd.choose("e1", True, req, now=100.0 + TRUST_S + 2) is None for _ in range(5))


async def test_trust_is_per_shape_of_request() -> None:
    fwd = PromptIdForwarding("all", random.Random(1))
    plain = await sized("chat", chat())
    with_tools = await sized("chat", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]))
    comp = await sized("completion", completion())
    assert len({shape_of(plain), shape_of(with_tools), shape_of(comp)}) == 3
    long = await sized("completion", completion(" ".join(["word"] * 5000)))
    assert shape_of(long) != shape_of(comp)  # another length class
    for _ in range(VERIFY_FIRST):
        fwd.observed("e1", "r", comp, list(comp.own_ids or ()), now=1.0)
    # completions vouch for completions of their shape only: not for chats, nor for long prompts
    assert any(fwd.choose("e1", True, comp, now=1.0) is not None for _ in range(5))
    for other in (plain, with_tools, long):
        assert fwd.choose("e1", True, other, now=1.0) is None
    for _ in range(VERIFY_FIRST):
        fwd.observed("e1", "r", plain, list(plain.own_ids or ()), now=1.0)
    assert any(fwd.choose("e1", True, plain, now=1.0) is not None for _ in range(5))
    assert fwd.choose("e1", True, with_tools, now=1.0) is None
    assert fwd.choose("e2", True, plain, now=1.0) is None  # and per engine


async def test_a_chat_goes_as_ids_with_mode_all_only_and_never_when_echoed() -> None:
    for mode, forwarded in (("completions", False), ("all", True)):
        fleet = Fleet(mode)
        try:
            req = await sized("chat", chat())
            want = await fleet.ask(req)
            for _ in range(VERIFY_FIRST):
                assert await fleet.ask(req) == want
            got = await fleet.ask(req)
            kvp = fleet.sent().get("kv_transfer_params") or {}
            if forwarded and "prompt_token_ids" not in kvp:  # (a random recheck: the next one goes as IDs)
                got = await fleet.ask(req)
                kvp = fleet.sent().get("kv_transfer_params") or {}
            assert ("prompt_token_ids" in kvp) is forwarded, mode
            if forwarded:
                assert kvp["prompt_token_ids"] == list(req.own_ids or ())
                assert fleet.sent()["messages"] == chat()["messages"]  # the messages still go along
            assert got == want
            with pytest.raises(UnsupportedOption):  # (echo is refused: protocol/options.py check_relayed_options)
                await sized("chat", chat(echo=True))
        finally:
            await fleet.close()


async def test_a_disagreement_stops_the_ids_to_that_engine() -> None:
    fleet = Fleet()
    try:
        req = await sized("completion", completion())
        assert req.own_ids is not None
        # a router whose tokenizer reads one prompt otherwise (its IDs are not the engine's)
        wrong = dataclasses.replace(req, own_ids=(*req.own_ids[:-1], req.own_ids[-1] + 1))
        for i in range(VERIFY_FIRST - 1):
            await fleet.ask(req, f"ok-{i}")
        await fleet.ask(wrong, "the-odd-one")
        row = fleet.relay.forwarding.status()["engines"]["e1"]["completion"]
        assert row["disagreed"] == ["the-odd-one"]
        for _ in range(5):
            await fleet.ask(req)
            assert isinstance(fleet.sent()["prompt"], str)  # text from now on
        assert fleet.relay.forwarding.status()["engines"]["e1"]["completion"]["forwarded"] == 0
        fleet.relay.forwarding.forget("e1")  # a disagreement is not forgotten with the engine
        assert fleet.relay.forwarding.choose("e1", True, req, time.time()) is None
    finally:
        await fleet.close()


async def test_a_rendering_field_sent_as_null_or_a_number_is_a_shape_of_its_own() -> None:
    """Found by a hostile probe: ``add_special_tokens: null`` or ``0`` counted as the field left out,
    so once plain completions were trusted they went as the router's IDs unchecked, and the engine
    read them otherwise (silently a different answer); one sent as text when the default shape's
    trust was old turned IDs off for every client's plain completions."""
    forms = [{}, {"add_special_tokens": True}, {"add_special_tokens": False}, {"add_special_tokens": 1},
             {"add_special_tokens": 0}, {"add_special_tokens": 0.0}, {"add_special_tokens": None},
             {"add_special_tokens": "false"}, {"add_special_tokens": [1]}, {"add_special_tokens": {"a": 1}}]
    shapes = [shape_of(dataclasses.replace(await sized("completion", completion()), body=completion(**f))) for f in forms]
    assert len(set(shapes)) == len(forms)  # (True == 1 and 0 == False in Python: not here)
    fleet = Fleet()
    try:
        plain = await sized("completion", completion())
        for _ in range(VERIFY_FIRST):
            await fleet.ask(plain)
        # the simulator is vLLM here: null is refused, 0 is False (lax booleans); the router sizes
        # what is not a boolean with the estimate, so neither can go as IDs
        for value in (None, 0):
            odd = await sized("completion", completion(add_special_tokens=value))
            assert odd.own_ids is None and fleet.relay.forwarding.choose("e1", True, odd, time.time()) is None
        await fleet.ask(plain)
        await fleet.ask(plain)
        assert list(plain.own_ids or ()) in (fleet.sent()["prompt"], fleet.engine.recent[-2]["body"]["prompt"])
        row = fleet.relay.forwarding.status()["engines"]["e1"]["completion"]
        assert row["disagreed"] == [] and row["forwarded"] >= 1
        for value, status in ((None, 400), (0, 200)):  # vLLM's lax boolean
            r = await fleet.client.post("http://sim/v1/completions", json={
                "prompt": "the quick", "max_tokens": 1, "add_special_tokens": value, "return_token_ids": True})
            assert r.status_code == status, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == list((await sized("completion", completion(
            "the quick", add_special_tokens=False))).own_ids or ())  # 0 read as False
        # and a shape the router does size, trusted apart: no IDs for it before its own agreements
        fwd = PromptIdForwarding("all", random.Random(1))
        off = await sized("completion", completion(add_special_tokens=False))
        for _ in range(VERIFY_FIRST):
            fwd.observed("e1", "r", plain, list(plain.own_ids or ()), now=1.0)
        assert fwd.choose("e1", True, off, now=1.0) is None
    finally:
        await fleet.close()


async def test_the_shape_table_is_bounded_by_recency_and_keeps_disagreements() -> None:
    """Found by a hostile probe: 4,100 chats with made-up ``reasoning_effort`` values filled the
    table for good (later shapes were neither forwarded nor checked). (``reasoning_effort`` is now
    refused past vLLM's values: the shapes here come from ``tool_choice`` strings.)"""
    fwd = PromptIdForwarding("all", random.Random(1), max_shapes=4)
    plain = await sized("chat", chat())
    bad = await sized("chat", chat(tool_choice="odd"))
    for _ in range(VERIFY_FIRST):
        fwd.observed("e1", "r", plain, list(plain.own_ids or ()), now=1.0)
    fwd.observed("e1", "bad-1", bad, [1, 2, 3], now=1.0)  # a disagreement
    for i in range(10):  # a client sending ever new shapes
        junk = await sized("chat", chat(tool_choice=f"x{i}"))
        fwd.choose("e1", True, junk, now=1.0)
        if i == 1:
            assert any(fwd.choose("e1", True, plain, now=1.0) is not None for _ in range(5))  # still trusted
    assert all(fwd.choose("e1", True, plain, now=1.0) is None for _ in range(5))  # pushed out: starts over
    for _ in range(VERIFY_FIRST):
        fwd.observed("e1", "r", plain, list(plain.own_ids or ()), now=1.0)
    assert any(fwd.choose("e1", True, plain, now=1.0) is not None for _ in range(5))  # and is checked again
    rows = fwd.status()["engines"]["e1"]["chat"]
    assert rows["disagreed"] == ["bad-1"] and rows["shapes"] == 4  # the disagreement stayed
    assert fwd.choose("e1", True, bad, now=1.0) is None
    full = PromptIdForwarding("all", random.Random(1), max_shapes=1)
    full.observed("e1", "bad-2", bad, [1, 2, 3], now=1.0)
    assert full._get("e1", shape_of(plain)) is None  # nothing but disagreements: new shapes go as text


@pytest.mark.parametrize("dialect", ["sglang", "openai"])
async def test_engines_of_other_dialects_always_get_the_text(dialect: str) -> None:
    assert not DIALECTS[dialect].takes_prompt_ids
    fwd = PromptIdForwarding("all", random.Random(1))
    req = await sized("completion", completion())
    for _ in range(VERIFY_FIRST):
        fwd.observed("e1", "r", req, list(req.own_ids or ()), now=1.0)
    assert any(fwd.choose("e1", True, req, now=1.0) is not None for _ in range(5))
    assert fwd.choose("e1", DIALECTS[dialect].takes_prompt_ids, req, now=1.0) is None


async def test_only_the_routers_own_tokenization_goes_as_ids() -> None:
    fwd = PromptIdForwarding("all")
    ids_prompt = await sized("completion", {"prompt": [5, 6, 7], "max_tokens": 2})
    assert ids_prompt.own_ids is None and not fwd.wanted(ids_prompt)  # the client's IDs go as they came
    cut = await sized("completion", completion(truncate_prompt_tokens=3))
    assert cut.own_ids is None and not fwd.wanted(cut)  # the engine cuts a text prompt itself
    assert not PromptIdForwarding("off").wanted(await sized("completion", completion()))
    with pytest.raises(UnsupportedOption):  # (echo is refused before it could go as IDs)
        await sized("completion", completion(echo=True))
    # a suffix is rendered with the prompt's text (or refused with IDs): text, and not checked either
    fim = await sized("completion", completion(suffix="return 1"))
    assert fim.own_ids and not fwd.wanted(fim)
    assert fwd.observed("e1", "r", fim, [1, 2, 3], now=1.0) is None
    # an empty prompt would be no prompt at all as IDs (vLLM refuses the empty text)
    empty = await sized("completion", {"prompt": [""], "max_tokens": 2, "add_special_tokens": False})
    assert empty.own_ids == () and not fwd.wanted(empty)


async def test_a_pd_pair_gets_the_ids_on_both_legs_beside_the_prefill_answer() -> None:
    req = await sized("chat", chat())
    ids = req.own_ids
    assert ids is not None
    prefill = VLLM.with_prompt_ids(VLLM.prefill_body(req), "chat", ids)
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["kv_transfer_params"]["prompt_token_ids"] == list(ids)
    answer = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p"}
    decode = VLLM.with_prompt_ids(VLLM.decode_body(req, answer), "chat", ids)
    assert decode["kv_transfer_params"] == {**answer, "prompt_token_ids": list(ids)}
    assert answer == {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p"}  # not changed
    comp = await sized("completion", completion())
    assert comp.own_ids is not None
    body = VLLM.with_prompt_ids(VLLM.decode_body(comp), "completion", comp.own_ids)
    assert body["prompt"] == list(comp.own_ids) and "kv_transfer_params" not in body


async def test_the_simulator_takes_and_checks_a_chats_ids_as_vllm() -> None:
    app = create_app(SimEngineConfig(name="e1", eos_prob=0))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as c:
        base = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "return_token_ids": True}
        r = await c.post("/v1/chat/completions", json={**base, "kv_transfer_params": {"prompt_token_ids": [7, 8, 9]}})
        assert r.status_code == 200 and r.json()["prompt_token_ids"] == [7, 8, 9], r.text
        assert r.json()["usage"]["prompt_tokens"] == 3
        for bad in ([], [1, -2], [1, True], "12"):
            r = await c.post("/v1/chat/completions", json={**base, "kv_transfer_params": {"prompt_token_ids": bad}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.prompt_token_ids", bad
        media = {**base, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 "kv_transfer_params": {"prompt_token_ids": [7, 8, 9]}}
        r = await c.post("/v1/chat/completions", json=media)  # non-text content: rendered, the IDs ignored
        assert r.status_code == 200 and r.json()["prompt_token_ids"] != [7, 8, 9]
