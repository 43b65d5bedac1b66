"""The fields a chat is rendered with are typed as vLLM 0.32's request model types them, on the
completion route and on /tokenize (found by a hostile probe of the run mode: a wrong type was
admitted and placed, then refused by the engine, and /tokenize answered it with a count; each
case here failed before its fix)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from narwhal_serve.errors import InvalidRequest
from narwhal_serve.gateway.tokenize import tokenize
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.tokenization.hf import HfTokenizer
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.tokenizer import build_tiny_tokenizer

BAD: list[tuple[str, Any]] = [
    ("continue_final_message", "x"), ("continue_final_message", None), ("add_generation_prompt", None),
    ("add_generation_prompt", 2), ("add_generation_prompt", " true"), ("add_generation_prompt", 0.5),
    ("chat_template_kwargs", 1), ("chat_template_kwargs", [1]),
    ("chat_template_kwargs", "x"), ("documents", 1), ("documents", [{"title": 1}]), ("documents", ["x"]),
    ("reasoning_effort", 1), ("reasoning_effort", "extreme"), ("tools", "x"), ("tools", ["x"]),
]
GOOD: list[tuple[str, Any]] = [
    ("continue_final_message", False), ("add_generation_prompt", True), ("chat_template_kwargs", None),
    ("add_generation_prompt", 1), ("add_generation_prompt", "false"), ("continue_final_message", "No"),
    ("continue_final_message", 0.0),
    ("chat_template_kwargs", {"enable_thinking": False}), ("documents", [{"title": "t", "text": "x"}]),
    ("documents", None), ("reasoning_effort", "minimal"), ("reasoning_effort", None), ("tools", []),
]


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


@pytest.mark.parametrize("key,value", BAD)
def test_a_wrong_type_is_a_400_naming_the_field(key: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_request("chat", json.dumps(_chat(**{key: value})).encode(), model="m")
    assert err.value.info().param == key


@pytest.mark.parametrize("key,value", GOOD)
def test_what_vllm_takes_is_taken(key: str, value: Any) -> None:
    """(vLLM reads a bool in pydantic's lax mode: 0/1, "false", "No"... are booleans, and reach the
    template, and the engine, as JSON booleans — the string "false" would be true to a template)"""
    req = parse_request("chat", json.dumps(_chat(**{key: value})).encode(), model="m")
    if key in ("add_generation_prompt", "continue_final_message"):
        assert req.body[key] is {1: True, 0: False, "false": False, "No": False}.get(value, value), req.body[key]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(build_tiny_tokenizer(Path(tmp_path_factory.mktemp("tok"))))


@pytest.mark.parametrize("key,value", [(k, v) for k, v in BAD if k not in ("documents", "reasoning_effort")])
def test_tokenize_refuses_them_too(tok: HfTokenizer, key: str, value: Any) -> None:
    """(vLLM's tokenize request has no ``documents`` nor ``reasoning_effort``: it ignores them, and so does
    the router's /tokenize)"""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], key: value}
    with pytest.raises(InvalidRequest) as err:
        asyncio.run(tokenize(PromptSizer(tok), "m", json.dumps(body).encode()))
    assert err.value.info().param == key
