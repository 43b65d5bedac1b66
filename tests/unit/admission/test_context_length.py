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
from narwhal_serve.scheduler.monitor import CONTEXT_REASK_S, context_of, scrape_one
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


def test_an_output_limit_past_every_context_is_a_400_whatever_the_prompt() -> None:
    """vLLM 0.32 refuses ``max_tokens`` (or a chat's ``max_completion_tokens``) past the context
    before it looks at the prompt, in these words; a limit the prompt leaves no room for is cut to
    the room left (served). In a fleet of mixed contexts such a request goes where the limit fits."""
    v = view(engine("a", context=4096), engine("b", context=4096))
    for param in ("max_tokens", "max_completion_tokens"):
        out = refused(v, Ask(10, 30.0, max_output_tokens=4097, output_param=param))  # (estimated or not)
        assert (out.outcome, out.error.status, out.error.code, out.error.param) == (
            Outcome.INVALID, 400, "context_length_exceeded", param)
        assert out.error.message == (f"{param}=4097 cannot be greater than max_model_len=4096. Please request fewer "
                                     "output tokens.")
    assert placed(v, Ask(10, 30.0, max_output_tokens=4096)).engines
    assert placed(v, Ask(4000, 30.0, max_output_tokens=4096, exact=True)).engines  # (cut to 96 by the engine)
    assert placed(view(engine("a", context=4096), engine("b")), Ask(10, 30.0, max_output_tokens=5000)).engines
    small = [engine(f"s{i}", context=2048) for i in range(10)]
    big = engine("big", context=32768, inflight=5)
    assert [r.decode.name for r in placed(view(*small, big), Ask(10, 30.0, max_output_tokens=4000)).routes] == ["big"]
    assert "big" not in placed(view(*small, big), Ask(10, 30.0, max_output_tokens=2048)).engines


def test_a_truncation_past_every_context_is_a_400_in_vllms_words() -> None:
    """vLLM 0.32 refuses ``truncate_prompt_tokens`` N past its context (``max_model_len``) whatever
    the prompt, after the output limit and before the prompt's length (renderers/params.py
    TokenizeParams); N equal to it is taken. In a fleet of mixed contexts such a request goes only
    where N fits, as a prompt that long would."""
    v = view(engine("a", context=4096), engine("b", context=4096))
    for size, exact in ((10, False), (9000, True)):  # (a short prompt, or one past the context it would be cut from)
        out = refused(v, Ask(size, 30.0, exact=exact, truncate_to=4097))
        assert (out.outcome, out.error.status, out.error.code, out.error.param) == (
            Outcome.INVALID, 400, "context_length_exceeded", "truncate_prompt_tokens")
        assert out.error.message == ("truncate_prompt_tokens=4097 cannot be greater than max_model_len = 4096. "
                                     "Please request a smaller truncation size.")
    out = refused(v, Ask(10, 30.0, max_output_tokens=5000, truncate_to=4097))  # vLLM checks the output limit first
    assert out.error.param == "max_tokens"
    assert placed(v, Ask(10, 30.0, truncate_to=4096)).engines
    assert placed(view(engine("a", context=4096), engine("b")), Ask(10, 30.0, truncate_to=5000)).engines  # (b may)
    small = [engine(f"s{i}", context=2048) for i in range(10)]
    big = engine("big", context=32768, inflight=5)
    assert [r.decode.name for r in placed(view(*small, big), Ask(10, 30.0, truncate_to=2049)).routes] == ["big"]
    assert "big" not in placed(view(*small, big), Ask(10, 30.0, truncate_to=2048)).engines


def test_truncation_fields_are_checked_and_a_whole_float_taken() -> None:
    """``truncate_prompt_tokens`` is read by the router (sizing, placement): a whole-number float is
    taken as vLLM's schema takes it and sent on as the integer; what vLLM refuses (below -1, a
    fraction) and a wrong type are 400s naming the field, as is a ``truncation_side`` not vLLM's."""
    from narwhal_serve.errors import InvalidRequest
    from narwhal_serve.protocol.requests import parse_request, truncated_to

    def parsed(**extra: object):  # type: ignore[no-untyped-def]
        return parse_request("completion", json.dumps({"model": "m", "prompt": [1, 2, 3], **extra}).encode(), model="m")

    p = parsed(truncate_prompt_tokens=2.0)
    assert p.body["truncate_prompt_tokens"] == 2 and type(p.body["truncate_prompt_tokens"]) is int
    assert truncated_to(p.body) == 2 and p.prompt_tokens == 2
    for n in (-1, 0):
        assert truncated_to(parsed(truncate_prompt_tokens=n).body) is None  # (a length the engine picks; none)
    assert parsed(truncation_side="right", truncate_prompt_tokens=None).prompt_tokens == 3
    for key, value in (("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", 2.5), ("truncate_prompt_tokens", "3"),
                       ("truncate_prompt_tokens", True), ("truncate_prompt_tokens", 2**63),
                       ("truncation_side", "middle"), ("truncation_side", 1)):
        try:
            parsed(**{key: value})
        except InvalidRequest as exc:
            assert (exc.status, exc.param) == (400, key), (key, value)
        else:
            raise AssertionError(f"{key}={value!r} was let through")


def test_the_fleet_context_follows_an_engine_restarted_with_another() -> None:
    a, b = engine("a", context=4096), engine("b", context=4096)
    v = view(a, b)
    assert (v.context().shortest, v.context().longest) == (4096, 4096)
    delta = FleetView(engines=(replace(b, context=16384),), unavailable=None, predictive=True)
    merged = v.merged(delta, ())
    assert merged is not None and (merged.context().shortest, merged.context().longest) == (4096, 16384)
    assert placed(merged, Ask(8000, 30.0, exact=True)).engines == ("b",)
    same = merged.merged(FleetView(engines=(replace(a, inflight=3),), unavailable=None, predictive=True), ())
    assert same is not None and (same.context().shortest, same.context().longest) == (4096, 16384)


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
        state.update(models=503)  # a 5xx is no answer: kept, asked again at the next scrape
        e.context_asked = None
        await scrape_one(client, e, 6.0, 1.0)
        assert e.healthy and e.context == 8192 and asked.count("/v1/models") == 4
        state.update(models=200, len=4096)  # restarted behind the same address, never seen down
        await scrape_one(client, e, 7.0, 1.0)
        assert e.context == 4096 and asked.count("/v1/models") == 5
        await scrape_one(client, e, 7.0 + CONTEXT_REASK_S - 1, 1.0)
        assert asked.count("/v1/models") == 5
        state.update(len=2048)
        await scrape_one(client, e, 7.0 + CONTEXT_REASK_S, 1.0)  # asked again every minute
        assert e.context == 2048 and asked.count("/v1/models") == 6
        state["up"] = False
        await scrape_one(client, e, 100.0, 1.0)
        state.update(up=True, models=404)  # back, as a server without model cards
        await scrape_one(client, e, 101.0, 1.0)
        assert e.healthy and e.context == 0
        await scrape_one(client, e, 102.0, 1.0)
        assert asked.count("/v1/models") == 7


def test_an_engine_of_unknown_context_keeps_the_refusal_off_but_not_the_placement() -> None:
    """(Found by a review.) An engine that has not said its context (a plain server, a model card
    that failed) may take any prompt: no refusal while it is in the fleet; but the engines that
    said a shorter one still get no prompt they cannot hold."""
    small = [engine(f"s{i}", context=2048) for i in range(4)]
    v = view(*small, engine("quiet", inflight=3), engine("big", context=32768, inflight=5))
    p = placed(v, Ask(3000, 30.0, exact=True))
    assert p.engines and not any(r.decode.name.startswith("s") for r in p.routes)


def test_a_pd_fleet_of_mixed_prefill_contexts_is_not_told_to_retry_forever() -> None:
    """(Found by a review.) A P/D order pairs each decode engine with its least loaded prefill
    engine: a prompt only the busier prefill engine holds has no such route.  It used to be a 503
    ``backend_unavailable`` (Retry-After 1) for as long as the short engine stayed the less loaded;
    the routes go as they are, and the engine answers."""
    from narwhal_serve.config import EngineConfig as Cfg

    def pd(name: str, role: str, **kw: object) -> object:
        return replace(engine(name, **kw), cfg=Cfg(name=name, url=f"http://{name}", role=role))  # type: ignore[arg-type]

    v = view(pd("p-short", "prefill", context=2048), pd("p-long", "prefill", context=32768, inflight=4),
             pd("d", "decode", context=32768))  # type: ignore[arg-type]
    out = decide(v, Ask(3000, 30.0, exact=True), NOW, 0)
    assert not (hasattr(out, "error") and out.error.code == "backend_unavailable"), out  # type: ignore[union-attr]
    assert refused(v, Ask(40000, 30.0, exact=True)).error.code == "context_length_exceeded"


async def test_a_token_id_prompt_the_engine_truncates_is_sized_as_the_engine_keeps_it() -> None:
    """``truncate_prompt_tokens`` N ≥ 1 with token IDs: a generating vLLM engine keeps the last N
    (the first N with ``truncation_side: "right"``; vLLM 0.32 renderers/params.py), so the router's
    IDs (prefix blocks, size) are those, exactly; checks their vocabulary only (the engine checks
    those it kept), naming a bad one by its place in the prompt sent.  -1 (the context less one: a
    length the engine picks) is not exact."""
    from narwhal_serve.errors import InvalidRequest
    from narwhal_serve.protocol.requests import parse_request
    from narwhal_serve.sim.tokenizer import SimTokenizer
    from narwhal_serve.tokenization.sizer import PromptSizer

    sizer = PromptSizer(SimTokenizer())
    ids = [1 + i % 2000 for i in range(10_000)]  # (within the simulator's vocabulary)

    async def sized(**extra: object):  # type: ignore[no-untyped-def]
        raw = json.dumps({"model": "m", "prompt": ids, **extra}).encode()
        return await sizer.size(parse_request("completion", raw, model="m"))

    left = await sized(truncate_prompt_tokens=4000)
    assert left.exact and left.ids == ids[-4000:] and left.parsed.prompt_tokens == 4000
    right = await sized(truncate_prompt_tokens=4000, truncation_side="right")
    assert right.exact and right.ids == ids[:4000] and right.parsed.prompt_tokens == 4000
    whole = await sized(truncate_prompt_tokens=20_000)
    assert whole.exact and whole.ids == ids and whole.parsed.prompt_tokens == 10_000
    context = await sized(truncate_prompt_tokens=-1)
    assert not context.exact and context.ids == ids
    assert (await sized()).exact
    vocab = SimTokenizer().vocab_size
    ids[0] = vocab  # outside the vocabulary, in the part the engine cuts off: it never sees it
    assert (await sized(truncate_prompt_tokens=10)).ids == ids[-10:]
    ids[-3] = vocab  # in the part it keeps
    for extra, want in (({"truncate_prompt_tokens": 10}, f"prompt.{len(ids) - 3}"), ({}, "prompt.0")):
        try:
            await sized(**extra)
        except InvalidRequest as exc:
            assert exc.param == want, exc.param
        else:
            raise AssertionError("a token ID outside the vocabulary was let through")


async def test_both_holders_refuse_it_and_keep_nothing() -> None:
    """The row runs where the decision runs: an ingress's lease (on the scheduler's grant, rows
    across the hop) and the scheduler (an AdmitRequest across the hop, ``exact`` in it).  Either way
    a 400 counted ``invalid_requests``, with no permit held after."""
    from narwhal_serve.admission.controller import Refusal
    from narwhal_serve.admission.lease import NONE
    from narwhal_serve.scheduler.messages import AdmitRequest
    from tests.unit.admission.test_lease import Holder, service

    for mode in ("predictive", "open"):
        svc, clock = service(mode)
        for e in svc.engines.values():
            e.context = 4096
        svc.views_stale()
        h = Holder(svc, clock)
        h.sync()
        verdict = h.lease.try_admit("long", Ask(5000, 30.0, exact=True), clock() + 60, clock(), h.mono)
        assert isinstance(verdict, Refusal) and verdict.reason == "context_length_exceeded", verdict
        assert verdict.outcome is Outcome.INVALID and h.lease.in_use == NONE
        assert not isinstance(h.lease.try_admit("fits", Ask(4000, 30.0, exact=True), clock() + 60, clock(), h.mono),
                              Refusal)
        req = AdmitRequest.of("t-long", clock() + 60, Ask(5000, 30.0, exact=True))
        assert req.ask().exact is True
        res = await svc.admit(req)
        assert res.error is not None and res.error.code == "context_length_exceeded" and res.outcome is Outcome.INVALID
        assert "t-long" not in svc.admission.retained


async def test_a_resume_goes_only_where_the_continuation_fits() -> None:
    """(Found by a review.) A continuation's prompt is the prompt and the output so far: an engine
    whose context it fills would refuse it, and the answer would end with an error event though
    another engine could go on."""
    from tests.unit.admission.test_lease import Holder, service

    svc, clock = service("predictive")
    svc.engines["u"].context, svc.engines["d"].context, svc.engines["p"].context = 4096, 1024, 1024
    svc.views_stale()
    h = Holder(svc, clock)
    h.sync()
    assert sorted(e.name for e in h.lease.resume_targets(clock(), 100)) == ["d", "u"]
    assert [e.name for e in h.lease.resume_targets(clock(), 2000)] == ["u"]
    assert h.lease.resume_targets(clock(), 5000) == []


def test_every_field_of_an_ask_crosses_the_ray_hop() -> None:
    """An ask the scheduler decides (no lease, or a lease out of permits) is the one the ingress
    made, every field set apart from its default (a truncation included)."""
    import dataclasses
    import pickle

    from narwhal_serve.scheduler.messages import AdmitRequest

    odd: dict[str, object] = {"prompt_tokens": 7, "ttft_budget_s": 1.5, "tpot_budget_s": 0.05, "kind": "completion",
                              "max_output_tokens": 9, "prefix": (1, 2), "prefix_block_tokens": 16.0, "retry": True,
                              "reserves": True, "tenant": "t", "fingerprint": "f", "rank": 2, "admit_within_s": 0.7,
                              "node": "n", "min_output_tokens": 3, "exact": True, "output_param": "max_completion_tokens",
                              "truncate_to": 5, "waited_s": 0.25}
    assert set(odd) == {f.name for f in dataclasses.fields(Ask)}, "a new Ask field: add it here and to AdmitRequest"
    ask = Ask(**odd)  # type: ignore[arg-type]
    assert all(getattr(ask, f.name) != f.default for f in dataclasses.fields(Ask) if f.default is not dataclasses.MISSING)
    assert pickle.loads(pickle.dumps(AdmitRequest.of("x", 1.0, ask))).ask() == ask
