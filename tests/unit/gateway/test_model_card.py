"""The non-completion routes beside vLLM 0.32's server (a differential review; the two card tests
failed before their fixes): the model card's fields a client of a vLLM server reads, and the
health and version routes it calls.

- ``root``: vLLM's card says where the model was loaded from (``ModelCard(root=base_model.model_path)``,
  vllm/entrypoints/openai/models/serving.py, ``BaseModelPath(model_path=args.model)``).  ``vllm bench
  serve`` without ``--model`` takes ``data[0]["root"]`` as its model id and, without ``--tokenizer``,
  loads its tokenizer from it (``get_tokenizer(tokenizer_id)``, vllm/benchmarks/serve.py).  Narwhal's
  card said the served name, which no tokenizer loads from: the benchmark failed before its first
  request.  Now the router's tokenizer directory (a managed vLLM engine's ``--model``).
- ``owned_by``: "vllm" only where every engine is of the vllm dialect (docs/contract.md, Routes); it
  was decided once from the config, so an engine of another dialect registered at run time
  (``POST /admin/engines``) left the card saying "vllm".
- ``/ping`` (GET and POST: SageMaker's health check) answers as ``/health`` does, as vLLM's does;
  ``/version`` says the router's version, in vLLM's shape.

The app is built in-process (no Ray) and called through httpx's ASGITransport, as the other gateway
tests do; the registration test runs the in-process router (tests/support/local_router.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from narwhal_serve.gateway.app import GatewayApp
from tests.support.local_router import LocalRouter, start_local_router
from tests.support.ray_env import ADMIN_TOKEN
from tests.support.fleetless import fleetless_app, tok_dir

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


__all__ = ["tok_dir"]  # (the fixture, shared)


def _app(tok_dir: Path) -> GatewayApp:
    # the served name is not where the model lives, as with `vllm serve <dir> --served-model-name tiny`
    return fleetless_app(tok_dir, model="tiny")


async def test_model_card_root_is_where_a_tokenizer_loads_from(tok_dir: Path) -> None:
    """``vllm bench serve --base-url <router> --dataset-name random`` (no --model, no --tokenizer) loads
    its tokenizer from the card's ``root`` with Hugging Face's AutoTokenizer (vLLM's get_tokenizer).
    vLLM's own card names the model's directory there; Narwhal's names the served model ("tiny"), and
    the load fails (OSError: no such local directory or Hub repository)."""
    transformers = pytest.importorskip("transformers")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app(tok_dir)), base_url="http://t") as c:
        r = await c.get("/v1/models")
    assert r.status_code == 200, r.text
    card = r.json()["data"][0]
    assert card["id"] == "tiny"
    try:
        tok = transformers.AutoTokenizer.from_pretrained(card["root"], local_files_only=True)
    except OSError as exc:
        pytest.fail(f"the card's root {card['root']!r} is not loadable as vllm bench serve loads it: {exc}")
    assert tok("hi")["input_ids"]


@pytest.fixture
async def router(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalRouter]:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    r = await start_local_router({"admission": {"mode": "open"}, "sim": {"engines": [{"name": "u0"}]}})
    yield r
    await r.stop()


async def test_owned_by_is_not_vllm_once_an_engine_of_another_dialect_is_registered(router: LocalRouter) -> None:
    """The contract: ``owned_by: "vllm"`` where every engine is of the vllm dialect, else "narwhal"
    (clients tell a vLLM server by it before they use vLLM's extras).  After an SGLang engine is
    registered the fleet is mixed, and the card still says "vllm" (decided from the config at start)."""
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["owned_by"] == "vllm"
        r = await c.post("/admin/engines", headers=ADMIN,
                         json={"name": "sg0", "url": "http://127.0.0.1:9", "dialect": "sglang"})
        assert r.status_code == 200, r.text
        owned_by = None
        for _ in range(20):  # the lease sees the registration after the admin answer's flush; allow a little more
            owned_by = (await c.get("/v1/models")).json()["data"][0]["owned_by"]
            if owned_by == "narwhal":
                break
            await asyncio.sleep(0.1)
    assert owned_by == "narwhal", owned_by


async def test_ping_answers_as_health_and_version_names_the_router(tok_dir: Path) -> None:
    """vLLM's /ping (GET and POST, SageMaker's container check) is its /health; /version is
    ``{"version": ...}``.  Both were 404s."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app(tok_dir)), base_url="http://t") as c:
        for method in ("GET", "POST"):
            r = await c.request(method, "/ping")
            assert r.status_code == 200, (method, r.text)
        r = await c.get("/version")
        assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]
        r = await c.delete("/ping")
        assert r.status_code == 405 and "GET" in r.headers["allow"] and "POST" in r.headers["allow"]


async def test_the_model_routes_ask_for_the_api_key_as_the_completion_routes(tok_dir: Path) -> None:
    """vLLM's --api-key guards every /v1/* route, /v1/models included, as OpenAI's API does, and
    clients check a key by listing the models (a UI's "verify connection").  Narwhal's listed them to
    a wrong key and to none."""
    import hashlib

    key = "sk-right"
    app = fleetless_app(tok_dir, model="tiny",
                        tenants={"list": [{"name": "t1", "key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}]})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for path in ("/v1/models", "/v1/models/tiny"):
            for auth in ({}, {"Authorization": "Bearer sk-wrong"}):
                r = await c.get(path, headers=auth)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, auth, r.text)
            r = await c.get(path, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, (path, r.text)
        r = await c.get("/health")  # the operator routes stay open
        assert r.status_code == 200
