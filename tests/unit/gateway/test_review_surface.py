"""Review of the gateway's HTTP surface and tenants (body.py, tenancy.py, app.py, admit.py,
tenants/*): each test shows a behaviour the contract promises that the code does not keep yet."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from narwhal_serve.config import NarwhalConfig, TenantsConfig
from narwhal_serve.gateway.app import build_api
from narwhal_serve.tenants.keys import KeyRing
from narwhal_serve.tokenization.hf import HfTokenizer
from narwhal_serve.tokenization.sizer import PromptSizer
from tests.support.fleetless import NoFleet, asgi_client, fleetless_app, tok_dir
from tests.support.local_router import start_local_router

__all__ = ["tok_dir"]  # (the fixture, shared)

CHAT = "/v1/chat/completions"


def sha(key: bytes | str) -> str:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).hexdigest()


# --- 1. admit.py: a tenant's concurrent slot, without admission leases ----------------------------

async def test_max_concurrent_is_not_exceeded_by_sequential_requests_without_ingress_leases() -> None:
    """docs/contract.md, "Tenants": "a client sending its next request as its last one ends is never
    over its limit"; "Concurrent requests: none" (overshoot).  With `admission.ingress_leases: false`
    (configuration.md: one admit call per request) the scheduler is not told first what ended at this
    replica (admit.py flushes only when a lease holds shares), so one client sending requests one
    after another at max_concurrent: 1 is refused 429 "concurrent requests" most of the time."""
    r = await start_local_router({
        "sim": {"engines": [{"name": "u", "role": "unified"}], "kv_events": False},
        "admission": {"ingress_leases": False},
        "tenants": {"list": [{"name": "acme", "key_sha256": [sha("k-acme")], "max_concurrent": 1}]},
    })
    try:
        body = {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with httpx.AsyncClient(base_url=r.url, timeout=30) as c:
            codes = []
            for _ in range(8):  # strictly one after another: never two in flight
                resp = await c.post(CHAT, json=body, headers={"Authorization": "Bearer k-acme"})
                codes.append(resp.status_code)
    finally:
        await r.stop()
    assert codes == [200] * 8, codes


# --- 2. app.py: /tokenize and /detokenize on a body timeout -----------------------------------------

@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_a_body_timeout_on_the_token_routes_closes_the_connection(tok_dir: Path, path: str) -> None:
    """docs/contract.md, "Errors": a body not complete within serving.body_timeout_s is a 408
    "answered with Connection: close: the rest of that body cannot be told from a next request".
    The completion routes add it; the token routes (app.py token_route) answer the 408 without it."""
    app = fleetless_app(tok_dir, model="tiny", serving={"body_timeout_s": 0.2})

    async def slow() -> AsyncIterator[bytes]:
        yield b'{"prompt":'
        await asyncio.sleep(1.0)
        yield b'"hi"}'

    async with asgi_client(app) as c:
        r = await c.post(path, content=slow(), headers={"content-type": "application/json"})
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
    assert r.headers.get("connection", "").lower() == "close", dict(r.headers)


def admin_app(tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The gateway app over a fleet whose admin calls answer their op, admin token ``adm-token``."""
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", "adm-token")

    class Fleet(NoFleet):
        async def admin(self, op: str, arg: object) -> object:
            return op

    conf = NarwhalConfig.model_validate({"tokenizer": str(tok_dir), "sim": {"engines": [{"name": "u0"}]}})
    return build_api(conf, Fleet(), sizer=PromptSizer(HfTokenizer(tok_dir)))


# --- 3. app.py: admin bodies nested past the limit ------------------------------------------------

@pytest.mark.parametrize("path", ["/admin/state", "/admin/drain", "/admin/maintenance"])
async def test_an_admin_body_nested_too_deep_is_a_400_not_a_500(tok_dir: Path, path: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/contract.md, "Errors": nesting deeper than 64 is a 400 invalid_request.  The admin routes
    parse with ``request.json()`` (no strict JSON, no size limit) and catch only ValueError: a deep
    body raises RecursionError, answered 500 internal_error (a "bug to report")."""
    app = admin_app(tok_dir, monkeypatch)
    deep = b'{"mode":' + b"[" * 5000 + b"]" * 5000 + b"}"
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # (Starlette re-raises after its 500)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post(path, content=deep, headers={"Authorization": "Bearer adm-token"})
    finally:
        await app.state.reporter.stop()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


# --- 4. tenants/keys.py: a digest bound to two tenants through the keys file ----------------------

def _ring(tmp_path: Path, file_text: str) -> KeyRing:
    path = tmp_path / "keys.txt"
    path.write_text(file_text)
    cfg = TenantsConfig.model_validate({
        "list": [{"name": "acme", "key_sha256": [sha("k-acme")]}, {"name": "bulk"}],
        "keys_file": str(path)})
    return KeyRing(cfg)


def test_a_keys_file_line_cannot_rebind_an_inline_key_to_another_tenant(tmp_path: Path) -> None:
    """config/tenants.py refuses one digest under two tenants because "the last match won: the key
    silently another tenant's" (contract: a key → *the* tenant whose digest matches).  The keys file
    is not checked against the inline digests: a line `bulk <acme's digest>` silently moves acme's
    key to bulk (KeyRing.identify keeps the last match), with bulk's budgets and priority."""
    ring = _ring(tmp_path, f"bulk {sha('k-acme')}\n")
    assert ring.identify("Bearer k-acme") == "acme"


def test_a_keys_file_digest_under_two_tenants_is_not_silently_the_last_ones(tmp_path: Path) -> None:
    """The same within the file: the first binding stands (or the line is skipped as a problem)."""
    ring = _ring(tmp_path, f"acme {sha('k-file')}\nbulk {sha('k-file')}\n")
    assert ring.identify("Bearer k-file") != "bulk"


# --- 5. tenants/keys.py: a blank bearer key -------------------------------------------------------

def test_a_blank_bearer_key_never_authenticates() -> None:
    """A blank key is no key (config: "a client's key is read stripped: a blank one is no key", and a
    blank serving.api_keys entry is refused).  A tenant digest of the empty string — what the
    documented `printf %s "$KEY" | sha256sum` gives when $KEY is unset — is accepted by the config,
    and then `Authorization: Bearer ` (no key at all) is that tenant: a missing key must be a 401."""
    try:  # (a fix may refuse the empty key's digest in the config instead)
        cfg = TenantsConfig.model_validate({"list": [{"name": "acme", "key_sha256": [sha("")]}]})
    except ValidationError:
        return
    ring = KeyRing(cfg)
    assert ring.identify("Bearer ") is None
    assert ring.identify("Bearer    ") is None


# --- 6. tenants/keys.py: a key with bytes outside ASCII -------------------------------------------

async def test_a_non_ascii_key_matches_the_digest_of_its_bytes(tok_dir: Path) -> None:
    """docs/contract.md: a key's digest is `printf %s "$KEY" | sha256sum`, the SHA-256 of the bytes
    the client sends.  Starlette decodes header bytes as Latin-1 and keys.digest_of re-encodes that
    as UTF-8: any key with a byte past 0x7f hashes differently and is refused 401."""
    key = "sk-clé-ключ".encode()
    app = fleetless_app(tok_dir, model="tiny", tenants={"list": [{"name": "acme", "key_sha256": [sha(key)]}]})
    async with asgi_client(app) as c:
        r = await c.get("/v1/models", headers={"Authorization": b"Bearer " + key})
    assert r.status_code == 200, r.text


# --- 7. app.py: the admin token's scheme, in any case; /tokenize with deeply nested tool arguments --

async def test_the_admin_bearer_scheme_is_read_in_any_case(tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 9110 §11.1: the authentication scheme is case-insensitive (tenant keys were read so; the
    admin token was compared with "Bearer " byte for byte: `bearer <token>` was a 401)."""
    app = admin_app(tok_dir, monkeypatch)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            ok = await c.post("/admin/state", json={"mode": "open"}, headers={"Authorization": "bearer adm-token"})
            wrong = await c.post("/admin/state", json={"mode": "open"}, headers={"Authorization": "Basic adm-token"})
            bare = await c.post("/admin/drain", headers={"Authorization": "BEARER  adm-token "})
    finally:
        await app.state.reporter.stop()
    assert ok.status_code == 200, ok.text
    assert wrong.status_code == 401
    assert bare.status_code == 200, bare.text  # (no body: the default grace)


async def test_tokenize_with_tool_arguments_nested_past_pythons_limit_is_a_400(tok_dir: Path) -> None:
    """A tool call's ``arguments`` string nested deeper than Python's recursion limit: /tokenize
    answered 500 internal_error (json.loads raised RecursionError out of the rendering)."""
    app = fleetless_app(tok_dir, model="tiny")
    deep = "[" * 5000 + "]" * 5000
    body = {"model": "tiny", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": deep}}]}]}
    async with asgi_client(app) as c:
        r = await c.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_promise_put_back_while_still_queued_is_counted_once() -> None:
    """tenants/promises.py: a taken promise leaves the deque lazily; put back (its request refused
    for another reason) it was inserted again, so the promises made after it counted it twice as
    ahead of them (a Retry-After longer than the truth)."""
    from narwhal_serve.tenants.amounts import Amounts
    from narwhal_serve.tenants.promises import Promise, Promises

    ps = Promises()
    first = Promise("a", due=10.0, until=12.0, cost=Amounts(requests=1.0))
    later = Promise("b", due=20.0, until=22.0, cost=Amounts(requests=1.0))
    ps.add(first)
    ps.add(later)
    ps.take(first)
    ps.put_back(first)
    assert ps.ahead_of(later, now=0.0) == Amounts(requests=1.0)
    assert sum(1 for q in ps.queue if q is first) == 1
