"""Where and whether a cut answer continues (relay/resume.py): the pure choices the relay makes at a cut."""

from __future__ import annotations

import json
from typing import Any

from narwhal_serve.config import EngineConfig
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.requests import ParsedRequest, parse_request
from narwhal_serve.relay.resume import Transcript, length_end, resume_refusal, resume_target


def engine(name: str, dialect: str = "vllm") -> EngineConfig:
    return EngineConfig.model_validate({"name": name, "url": f"http://127.0.0.1:1/{name}", "dialect": dialect})


def request(**extra: Any) -> tuple[ParsedRequest, Transcript]:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, **extra}
    req = parse_request("completion", json.dumps(body).encode(), model="m")
    t = Transcript(req)
    return req, t


def test_the_live_pool_comes_first_then_the_candidates_never_an_excluded_or_blind_engine() -> None:
    a, b, c, blind = engine("a"), engine("b"), engine("c"), engine("o", "openai")
    cands = [RouteChoice("single", c), RouteChoice("single", a)]
    assert resume_target([a, b], cands, excluded={"a"}) is b  # least loaded eligible now, not the failed one
    assert resume_target([blind], cands, excluded={"a"}) is c  # no token IDs there: a candidate instead
    assert resume_target([], cands, excluded={"a", "c"}) is None


def test_a_cut_is_refused_past_the_limit_or_the_deadline_and_where_it_cannot_be_exact() -> None:
    req, t = request()
    v = engine("v")
    assert resume_refusal(req, t, v, 0, 1, now=10.0, deadline=20.0) is None
    assert resume_refusal(req, t, v, 1, 1, now=10.0, deadline=20.0) == "limit"
    assert resume_refusal(req, t, v, 0, 1, now=20.0, deadline=20.0) == "deadline"
    assert resume_refusal(req, t, engine("o", "openai"), 0, 1, now=10.0, deadline=20.0) == "not_exact"
    t.reasoning = True
    assert resume_refusal(req, t, v, 0, 1, now=10.0, deadline=20.0) == "not_exact"


def test_an_answer_complete_at_the_cut_ends_with_length_in_its_routes_shape() -> None:
    req, t = request()
    t.meta = {"id": "cmpl-1", "object": "text_completion", "created": 1}
    end = length_end(req, t)
    assert end["choices"] == [{"index": 0, "finish_reason": "length", "stop_reason": None, "text": "", "logprobs": None}]
    assert end["id"] == "cmpl-1"
