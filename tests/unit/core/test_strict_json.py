"""Strict JSON at parse time: what an engine or the Ray hop cannot carry is a 400 naming param."""

import json

import pytest

from narwhal_serve.errors import InvalidRequest
from narwhal_serve.protocol.requests import MAX_NESTING, decode_json, parse_request

ROWS = [
    (b'{"a": NaN}', "a", "NaN"),  # named where it is (issue 24)
    (b'{"a": [Infinity]}', "a.0", "Infinity"),
    (b'{"a": -Infinity}', "a", "Infinity"),
    (b'{"a": 1e400}', "a", "out of range"),
    (b'{"b": {"c": [1, 2, -1e999]}}', "b.c.2", "out of range"),
    (b'{"a": "\\ud800"}', "a", "lone surrogate"),
    (b'{"a": ["x", "\\udfff"]}', "a.1", "lone surrogate"),
    (b'{"a": {"\\ud800": 1}}', "a.?", "lone surrogate"),
    # a surrogate sent raw (UTF-8 bytes ED A0 80, which json.loads passes through), or in UTF-16 (fuzz, issue 13)
    (b'{"a": "\xed\xa0\x80"}', "a", "lone surrogate"),
    (b'{"a": ["x", "b\xed\xbf\xbf"]}', "a.1", "lone surrogate"),
    ('{"a": "\ud800"}'.encode("utf-16-le", "surrogatepass"), "a", "lone surrogate"),
    (b'{"": ["\\ud800"]}', ".0", "lone surrogate"),  # a key "" still shows in the path
    (b"[" * 2000 + b"]" * 2000, None, "nests deeper"),
    (b'{"a": ' + b"[" * MAX_NESTING + b"]" * MAX_NESTING + b"}", "a" + ".0" * (MAX_NESTING - 1), "nests deeper"),
]


@pytest.mark.parametrize("raw,param,words", ROWS)
def test_refused_with_param(raw: bytes, param: str | None, words: str) -> None:
    with pytest.raises(InvalidRequest) as ei:
        decode_json(raw)
    info = ei.value.info()
    assert (info.status, info.param) == (400, param)
    assert words in info.message


def test_what_is_fine_stays_fine() -> None:
    assert decode_json(b'{"a": "\\ud83d\\ude00", "b": 1e308, "c": -0.0}')["a"] == "\U0001F600"
    assert decode_json(b'{"a": ' + b"[" * (MAX_NESTING - 1) + b"]" * (MAX_NESTING - 1) + b"}")


def test_an_empty_token_id_prompt_is_refused_nested_or_not() -> None:
    """``[[]]`` is as empty a prompt as ``[]`` (it used to pass with 0 prompt tokens)."""
    for prompt in ([], [[]]):
        raw = json.dumps({"model": "m", "prompt": prompt}).encode()
        with pytest.raises(InvalidRequest) as ei:
            parse_request("completion", raw, model="m")
        assert ei.value.param == "prompt"
    assert parse_request("completion", b'{"model": "m", "prompt": [[0]]}', model="m").prompt_token_ids == (0,)


def test_a_null_sampling_width_is_the_default_and_not_sent_on() -> None:
    """``n: null`` (and ``best_of``) is OpenAI's default, 1: accepted, and left out of what the
    engine gets (vLLM's schema refuses a null ``n`` with its own error)."""
    for route, body in (("chat", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": null, "best_of": null}'),
                        ("completion", b'{"model": "m", "prompt": "x", "n": null}')):
        req = parse_request(route, body, model="m")  # type: ignore[arg-type]
        assert "n" not in req.body and "best_of" not in req.body
