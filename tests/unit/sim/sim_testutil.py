"""Helpers shared by the ``test_sim_*`` files (imported by name: the test dirs have no ``__init__``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from narwhal_serve.sim.app import create_app
from narwhal_serve.config.sim import SimEngineConfig
from tests.support.sse import parse_sse  # noqa: F401  (re-exported for the test_sim_* files)


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32.0-cpu"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def load_json(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())



def load_sse(name: str) -> list[Any]:
    return parse_sse((FIXTURES / name).read_text())


def shape(obj: Any) -> Any:
    """Keys and value kinds (null/str/int/float/bool/list) of a JSON value; lists of objects by their
    first item."""
    if isinstance(obj, dict):
        if obj and all(isinstance(v, float) for v in obj.values()):
            return "token->logprob"  # a completion top_logprobs entry: keys are token strings
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj and isinstance(obj[0], dict | list) else "list"
    if obj is None:
        return "null"
    return type(obj).__name__


def keys_only(obj: Any) -> Any:
    """Like :func:`shape` but ignoring value kinds."""
    if isinstance(obj, dict):
        return {k: keys_only(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [keys_only(obj[0])] if obj else []
    return None


@asynccontextmanager
async def sim_client(**cfg: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(SimEngineConfig(**cfg))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client:
        yield client


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, **extra}


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 6, "ignore_eos": True, **extra}


def content_chunks(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e["choices"] and "role" not in e["choices"][0].get("delta", {})]
