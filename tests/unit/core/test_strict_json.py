"""Strict JSON at parse time: what an engine or the Ray hop cannot carry is a 400 naming param."""

import json

import pytest

from narwhal_serve.errors import InvalidRequest
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.protocol.strictjson import MAX_NESTING, decode_json

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


def test_whole_number_floats_are_integers_as_vllm_takes_them_and_fractions_are_refused() -> None:
    """``max_tokens: 2.0`` (a Python client's ``float(2)``): vLLM's schema takes it, so the router
    does and sends the integer on; ``2.5`` stays a 400 naming the field, as at vLLM."""
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3.0, ' \
           b'"top_logprobs": 2.0, "logprobs": true, "n": 1.0, "seed": 7.0, "min_tokens": 1.0}'
    req = parse_request("chat", chat, model="m")
    assert req.max_output_tokens == 3 and req.min_output_tokens == 1
    for key, value in (("max_completion_tokens", 3), ("top_logprobs", 2), ("n", 1), ("seed", 7), ("min_tokens", 1)):
        assert req.body[key] == value and type(req.body[key]) is int
    req = parse_request("completion", b'{"model": "m", "prompt": "x", "max_tokens": 4.0, "logprobs": 1.0, "best_of": 1.0}', model="m")
    assert (req.max_output_tokens, req.body["logprobs"], req.body["best_of"]) == (4, 1, 1)
    assert type(req.body["max_tokens"]) is int
    for route, raw, param in (("completion", b'{"model": "m", "prompt": "x", "max_tokens": 2.5}', "max_tokens"),
                              ("completion", b'{"model": "m", "prompt": "x", "logprobs": 0.5}', "logprobs"),
                              ("completion", b'{"model": "m", "prompt": "x", "seed": 1e19}', "seed"),
                              # (a boolean stays a boolean, as OpenAI has it: chat's logprobs 1.0 is refused)
                              ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 1.0}', "logprobs")):
        with pytest.raises(InvalidRequest) as ei:
            parse_request(route, raw, model="m")  # type: ignore[arg-type]
        assert ei.value.param == param


def test_token_id_prompts_as_whole_floats_are_token_ids_as_vllm_takes_them() -> None:
    """(Found by a review.) vLLM's completion schema takes ``prompt: [1.0, 2.0]`` (and ``[[1.0]]``)
    as token IDs; the router used to refuse it.  It is sent on as integers; ``1.5`` is still a 400."""
    for raw, ids in ((b'{"model": "m", "prompt": [1.0, 2, 3.0]}', [1, 2, 3]),
                     (b'{"model": "m", "prompt": [[4.0, 5.0]]}', [4, 5])):
        req = parse_request("completion", raw, model="m")
        assert req.prompt_token_ids == tuple(ids)
        sent = req.body["prompt"] if not isinstance(req.body["prompt"][0], list) else req.body["prompt"][0]
        assert sent == ids and all(type(t) is int for t in sent)
    for raw in (b'{"model": "m", "prompt": [1.5, 2]}', b'{"model": "m", "prompt": [[1.0, 2.5]]}'):
        with pytest.raises(InvalidRequest) as ei:
            parse_request("completion", raw, model="m")
        assert ei.value.param == "prompt"


def test_a_negative_token_id_is_named_by_its_place() -> None:
    """(Found by a hostile probe.) vLLM names a negative token ID by its place (``body.prompt.0``:
    "greater than or equal to 0"); the router said the prompt was missing."""
    for raw, param in ((b'{"model": "m", "prompt": [5, -1]}', "prompt.1"), (b'{"model": "m", "prompt": [[-2]]}', "prompt.0.0"),
                       (b'{"model": "m", "prompt": [-1.0]}', "prompt.0")):
        with pytest.raises(InvalidRequest) as ei:
            parse_request("completion", raw, model="m")
        assert ei.value.param == param and "must be a token id: an integer >= 0" in str(ei.value.info().message)


def test_a_tool_without_a_type_is_a_function_as_at_vllm() -> None:
    """vLLM's tool schema defaults ``type`` to ``function``: a non-streaming request with such a
    tool is assembled like any other; a tool of another type is still refused there."""
    tools = [{"function": {"name": "f", "parameters": {}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    assert parse_request("chat", json.dumps(body).encode(), model="m").body["tools"] == tools
    body["tools"] = [{"type": "custom", "custom": {"name": "f"}}]
    with pytest.raises(InvalidRequest) as ei:
        parse_request("chat", json.dumps(body).encode(), model="m")
    assert ei.value.param == "tools.0.type"


def test_stream_options_without_stream_are_refused_as_openai_and_vllm_refuse_them() -> None:
    """A non-streaming request with ``stream_options`` used to be served (the router streams from
    the engine anyway); OpenAI and vLLM both answer it with a 400, so the router does too.  An
    empty ``stream_options`` passes, as at vLLM."""
    for route, raw in (("chat", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}'),
                       ("completion", b'{"model": "m", "prompt": "x", "stream": false, "stream_options": {"include_usage": false}}')):
        with pytest.raises(InvalidRequest) as ei:
            parse_request(route, raw, model="m")  # type: ignore[arg-type]
        assert ei.value.param == "stream_options"
    assert parse_request("completion", b'{"model": "m", "prompt": "x", "stream_options": {}}', model="m")
    assert parse_request("completion", b'{"model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": true}}', model="m").include_usage


def test_a_prompt_the_engine_truncates_is_sized_at_most_as_it_keeps() -> None:
    """``truncate_prompt_tokens``: vLLM keeps at most that many of the prompt's tokens; a long
    prompt sent with it was judged (TTFT) at its whole length, and refused as over the budget
    on its own though the engine would prefill a few tokens."""
    ids = list(range(1, 100_001))
    for cut, want in ((10, 10), (200_000, 100_000), (-1, 100_000), (None, 100_000)):
        req = parse_request("completion", json.dumps({"model": "m", "prompt": ids, "truncate_prompt_tokens": cut}).encode(),
                            model="m")
        assert req.prompt_tokens == want and req.prompt_token_ids == tuple(ids), cut
    chat = {"model": "m", "messages": [{"role": "user", "content": "word " * 10_000}], "truncate_prompt_tokens": 50}
    assert parse_request("chat", json.dumps(chat).encode(), model="m").prompt_tokens == 50


def _refused(route: str, body: dict[str, object]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as ei:
        parse_request(route, json.dumps(body).encode(), model="m")  # type: ignore[arg-type]
    return ei.value


def test_no_model_is_the_configured_one_as_vllm_serves_its_default() -> None:
    """(Found by a hostile probe.) vLLM 0.32 serves a request without a model (absent, null or
    empty) with its default; the router refused it. Now it is the configured model, filled in so
    every engine is asked for it by name; another model is still a 404, a model not a string a 400."""
    for extra in ({}, {"model": None}, {"model": ""}):
        for route, body in (("chat", {"messages": [{"role": "user", "content": "x"}]}), ("completion", {"prompt": "x"})):
            assert parse_request(route, json.dumps({**body, **extra}).encode(), model="m").body["model"] == "m"  # type: ignore[arg-type]
    assert _refused("completion", {"model": "other", "prompt": "x"}).status == 404
    assert (_refused("completion", {"model": 5, "prompt": "x"}).status, _refused("completion", {"model": 5, "prompt": "x"}).param) == (400, "model")


def test_an_empty_text_prompt_is_refused_in_vllms_words() -> None:
    """(Found by a hostile probe.) vLLM 0.32 refuses ``prompt: ""`` (completion/protocol.py
    ``validate_prompt_and_prompt_embeds``); the router served it (a start token alone)."""
    e = _refused("completion", {"model": "m", "prompt": ""})
    assert (e.status, e.param, e.message) == (400, "prompt", "Either prompt or prompt_embeds must be provided and non-empty.")
    assert parse_request("completion", b'{"model": "m", "prompt": [""]}', model="m")  # (served by vLLM too)


def test_a_chats_max_tokens_beside_max_completion_tokens_is_only_typed() -> None:
    """(Found by a hostile probe.) vLLM 0.32 takes ``max_completion_tokens`` when not null and never
    reads ``max_tokens`` then (chat_completion/serving.py): ``max_tokens: 0`` beside it was a 400
    here. Its type is still checked, as vLLM's schema checks it; alone it is still at least 1."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    p = parse_request("chat", json.dumps({**chat, "max_completion_tokens": 5, "max_tokens": 0}).encode(), model="m")
    assert (p.max_output_tokens, p.max_output_param) == (5, "max_completion_tokens")
    assert _refused("chat", {**chat, "max_completion_tokens": 5, "max_tokens": "x"}).param == "max_tokens"
    assert _refused("chat", {**chat, "max_tokens": 0}).param == "max_tokens"
    assert _refused("completion", {"model": "m", "prompt": "x", "max_completion_tokens": 5, "max_tokens": 0}).param == "max_tokens"


def test_a_seed_past_64_bits_is_refused_as_vllm_bounds_it() -> None:
    for seed in (2**63, -2**63 - 1):
        assert _refused("completion", {"model": "m", "prompt": "x", "seed": seed}).param == "seed"
    for seed in (2**63 - 1, -2**63):
        assert parse_request("completion", json.dumps({"model": "m", "prompt": "x", "seed": seed}).encode(), model="m")
