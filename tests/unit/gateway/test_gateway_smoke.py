"""The gateway and scheduler in-process (no Ray): SGLang bootstrap P/D, OpenAI dialect, disconnects."""

import asyncio
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.local_router import LocalRouter, start_local_router

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
async def sglang() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({
        "admission": {"mode": "open"},
        "sim": {"engines": [{"name": "sg-prefill", "role": "prefill", "dialect": "sglang"},
                            {"name": "sg-decode", "role": "decode", "dialect": "sglang"}]},
    })
    yield r
    await r.stop()


@pytest.fixture(scope="module")
async def plain() -> AsyncIterator[LocalRouter]:
    r = await start_local_router({
        "admission": {"mode": "open"},
        "sim": {"engines": [{"name": "oa", "role": "unified", "dialect": "openai"}]},
    })
    yield r
    await r.stop()


def chat(stream: bool, **kw: object) -> dict[str, object]:
    return {"model": "narwhal-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": stream, **kw}


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_bootstrap_pd(sglang: LocalRouter, stream: bool) -> None:
    rid = f"sg-{stream}"
    async with httpx.AsyncClient(base_url=sglang.url, timeout=30) as c:
        r = await c.post(CHAT, json=chat(stream), headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    pre = [x for x in sglang.sim("sg-prefill").engine.recent if x["request_id"] == rid]
    dec = [x for x in sglang.sim("sg-decode").engine.recent if x["request_id"] == rid]
    assert len(pre) == 1 and len(dec) == 1
    keys = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    boot = {k: pre[0]["body"][k] for k in keys}
    assert boot == {k: dec[0]["body"][k] for k in keys}
    assert boot["bootstrap_host"] == "127.0.0.1" and 0 <= boot["bootstrap_room"] < 2**63
    snap = sglang.svc.snapshot()
    assert {e["token_accounting"] for e in snap["engines"]} == {"unavailable"}


async def test_openai_dialect_has_no_token_ids(plain: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=plain.url, timeout=30) as c:
        r = await c.post(CHAT, json=chat(False, return_token_ids=True))
        s = await c.post(CHAT, json=chat(True, return_token_ids=True))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert r.json()["usage"]["completion_tokens"] > 0
    assert s.status_code == 200 and "token_ids" not in s.text
    sent = plain.sim("oa").engine.recent[-1]["body"]
    assert "return_token_ids" not in sent and "stream_interval" not in sent
    assert plain.svc.snapshot()["engines"][0]["token_accounting"] == "unavailable"


def _short_body_then_close(url: str) -> None:
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            "Content-Length: 400\r\n\r\n".encode() + b'{"model": "narwh'
        )


async def test_body_that_ends_before_sizing_counts_unsized_offered(plain: LocalRouter) -> None:
    before = plain.svc.snapshot()["counters"]
    await asyncio.to_thread(_short_body_then_close, plain.url)
    for _ in range(500):  # bounded: the report arrives within a few event-loop turns
        await plain.app_reporter.flush()
        now = plain.svc.snapshot()["counters"]
        if now["unsized_offered"] > before["unsized_offered"]:
            break
        await asyncio.sleep(0.01)
    assert now["unsized_offered"] == before["unsized_offered"] + 1
    assert now["offered"] == before["offered"] + 1 and now["cancelled"] == before["cancelled"] + 1


async def test_no_redirect_from_the_host_header_and_no_long_echo(plain: LocalRouter) -> None:
    async with httpx.AsyncClient(base_url=plain.url, timeout=30, follow_redirects=False) as c:
        r = await c.post(CHAT + "/", json=chat(False), headers={"Host": "evil.example"})
        assert r.status_code == 404 and "location" not in r.headers, r.headers
        assert r.json()["error"]["code"] == "not_found"
        r = await c.post(CHAT, json={**chat(False), "model": "m" * 100_000})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert len(r.json()["error"]["message"]) < 300 and "100000 characters" in r.json()["error"]["message"]


async def test_a_model_is_retrieved_by_name_and_another_is_a_model_not_found(plain: LocalRouter) -> None:
    """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``): the served model's card, as
    listed; any other name, one with a ``/`` included, the 404 ``model_not_found`` envelope."""
    async with httpx.AsyncClient(base_url=plain.url, timeout=30) as c:
        listed = (await c.get("/v1/models")).json()["data"]
        r = await c.get(f"/v1/models/{listed[0]['id']}")
        assert r.status_code == 200 and [r.json()] == listed, r.text
        for other in ("nope", "org/model", "x" * 500):
            r = await c.get(f"/v1/models/{other}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert r.json()["error"]["param"] == "model" and len(r.json()["error"]["message"]) < 300
        r = await c.delete(f"/v1/models/{listed[0]['id']}")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


async def test_head_answers_as_get_without_a_body_and_a_405_names_the_methods_allowed(plain: LocalRouter) -> None:
    """Load balancers check health with HEAD: a GET route answers it as GET, without the body
    (RFC 9110); a method a route does not take is a 405 in the envelope with ``Allow``."""
    async with httpx.AsyncClient(base_url=plain.url, timeout=30) as c:
        for path in ("/health", "/v1/models", "/metrics"):
            got, head = await c.get(path), await c.head(path)
            assert got.status_code == head.status_code == 200, path
            assert head.content == b"" and head.headers.get("content-type") == got.headers.get("content-type"), path
        r = await c.get(CHAT)
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
        r = await c.head(CHAT)
        assert r.status_code == 405 and r.content == b"" and r.headers["allow"] == "POST"
        r = await c.post("/v1/models")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
        r = await c.delete("/health")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
