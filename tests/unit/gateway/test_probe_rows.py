"""Rows a hostile probe of `make run` found answered otherwise than vLLM 0.32 or the contract says
(each test failed before its fix):

- a chat with both ``continue_final_message`` and ``add_generation_prompt`` true, as sent (vLLM's
  ``check_generation_prompt`` runs on the raw values, so ``"false"`` is true there too): vLLM 0.32
  answers 400 on its chat route and its ``/tokenize``; the router's ``/tokenize`` answered 200 and its
  chat route admitted the request for the engine to refuse;
- a time header with a trailing no-break space (``2\\xa0``): HTTP's optional whitespace is space and
  tab only, and "a plain positive decimal number" (docs/contract.md) has none; ``str.strip`` took it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_serve.gateway.app import GatewayApp
from tests.support.fleetless import asgi_client, fleetless_app, tok_dir

__all__ = ["tok_dir"]  # (the fixture, shared)


def _app(tok_dir: Path) -> GatewayApp:
    # the served name is not where the model lives, as with `vllm serve <dir> --served-model-name tiny`
    return fleetless_app(tok_dir, model="tiny")


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]


@pytest.mark.parametrize("flags", [
    {"continue_final_message": True, "add_generation_prompt": True},
    {"continue_final_message": "false", "add_generation_prompt": 1},  # truthy as sent: vLLM refuses these too
])
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
async def test_both_generation_prompt_flags_are_refused_as_vllm_refuses_them(tok_dir: Path, flags: dict[str, Any],
                                                                             path: str) -> None:
    body = {"model": "tiny", "messages": CHAT, **flags}
    async with asgi_client(_app(tok_dir)) as c:
        r = await c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request"
    assert err["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


async def test_one_generation_prompt_flag_is_taken(tok_dir: Path) -> None:
    async with asgi_client(_app(tok_dir)) as c:
        for flags in ({"continue_final_message": True, "add_generation_prompt": False},
                      {"continue_final_message": "false", "add_generation_prompt": False}, {}):
            r = await c.post("/tokenize", json={"model": "tiny", "messages": CHAT, **flags})
            assert r.status_code == 200, (flags, r.text)


@pytest.mark.parametrize("value", ["2\xa0", "\xa02", "2\x85"])
async def test_a_time_header_with_a_unicode_space_is_refused(tok_dir: Path, value: str) -> None:
    body = {"model": "tiny", "messages": CHAT[:1]}
    async with asgi_client(_app(tok_dir)) as c:
        r = await c.post("/v1/chat/completions", json=body, headers={"X-TTFT-Target": value.encode("latin-1")})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x-ttft-target"
