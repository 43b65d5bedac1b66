"""What a request's body says about its output length at least, as admission expects it."""

from __future__ import annotations

import json

import pytest

from narwhal_serve.protocol.requests import parse_request

MODEL = "m"


def _parsed(route: str, **extra: object):  # type: ignore[no-untyped-def]
    body: dict[str, object] = {"model": MODEL, **extra}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return parse_request(route, json.dumps(body).encode(), model=MODEL)  # type: ignore[arg-type]


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_ignore_eos_writes_all_of_max_tokens(route: str) -> None:
    assert _parsed(route, max_tokens=128, ignore_eos=True).min_output_tokens == 128
    assert _parsed(route, max_tokens=128, ignore_eos=False).min_output_tokens == 0
    assert _parsed(route, ignore_eos=True).min_output_tokens == 0  # no length to count on


def test_min_tokens_is_a_floor_never_above_max_tokens() -> None:
    assert _parsed("completion", max_tokens=64, min_tokens=16).min_output_tokens == 16
    assert _parsed("completion", max_tokens=8, min_tokens=16).min_output_tokens == 8
    assert _parsed("completion", min_tokens=16).min_output_tokens == 16
    assert _parsed("chat", max_completion_tokens=32, ignore_eos=True).min_output_tokens == 32
    assert _parsed("completion").min_output_tokens == 0


def test_the_floor_crosses_the_ray_hop() -> None:
    """An ask the scheduler decides (no lease, or a lease out of permits) keeps its known length."""
    from narwhal_serve.admission.core import Ask
    from narwhal_serve.scheduler.messages import AdmitRequest

    ask = Ask(10, 5.0, max_output_tokens=64, min_output_tokens=64, tenant="t", rank=1, node="n")
    assert AdmitRequest.of("x", 1.0, ask).ask() == ask
