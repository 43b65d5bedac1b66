"""Options vLLM answers only in a form the router never asks for (it streams every answer from the
engine, with token IDs) are refused in the router's words; their harmless values pass."""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal_serve.errors import NarwhalError, UnsupportedOption
from narwhal_serve.protocol.requests import parse_request

M = [{"role": "user", "content": "hi"}]


def parse(route: str, **extra: Any) -> None:
    body = {"model": "m", **({"messages": M} if route == "chat" else {"prompt": "hi"}), **extra}
    parse_request(route, json.dumps(body).encode(), model="m")  # type: ignore[arg-type]


@pytest.mark.parametrize("route", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_refused_whatever_the_client_streams(route: str, stream: bool) -> None:
    for extra, param in (({"echo": True}, "echo"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
                         ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"use_beam_search": True}, "use_beam_search")):
        with pytest.raises(UnsupportedOption) as e:
            parse(route, stream=stream, **extra)
        assert e.value.info().param == param and e.value.info().status == 400


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_their_harmless_values_pass_and_wrong_types_are_invalid(route: str) -> None:
    parse(route, echo=False, use_beam_search=False, include_reasoning=True)
    parse(route, include_reasoning=False)  # (relayed; counted without token IDs: test_relay.py)
    parse(route, stream=True, prompt_logprobs=0)
    parse(route, stream=True, prompt_logprobs=None, echo=None)
    for extra in ({"echo": "yes"}, {"prompt_logprobs": -2}, {"prompt_logprobs": "1"}, {"use_beam_search": 1},
                  {"include_reasoning": "no"}):
        with pytest.raises(NarwhalError) as e:
            parse(route, **extra)
        assert e.value.info().code == "invalid_request", extra
