"""The seed's validation rows through the real graph: status, envelope, param, counter."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.integration.conftest import MODEL, Graph
from tests.integration.helpers import AUTH, counter, status

M = [{"role": "user", "content": "hi"}]
CASES: list[tuple[str, str, Any, int, str, str | None]] = [
    # (id, route, body (bytes or JSON), status, code, param)
    ("bad-json", "chat", b'{"model": ', 400, "invalid_request", None),
    ("not-object", "chat", b"[1, 2]", 400, "invalid_request", None),
    ("messages-missing", "chat", {"model": MODEL}, 400, "invalid_request", "messages"),
    ("content-type", "chat", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_request", "messages.0.content"),
    ("role-type", "chat", {"model": MODEL, "messages": [{"role": 1, "content": "x"}]}, 400, "invalid_request", "messages.0.role"),
    ("max-tokens-type", "chat", {"model": MODEL, "messages": M, "max_tokens": "9"}, 400, "invalid_request", "max_tokens"),
    ("stream-type", "completion", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "invalid_request", "stream"),
    ("prompt-type", "completion", {"model": MODEL, "prompt": {"a": 1}}, 400, "invalid_request", "prompt"),
    ("other-model", "chat", {"model": "gpt-4o", "messages": M}, 404, "model_not_found", "model"),
    ("n>1", "chat", {"model": MODEL, "messages": M, "n": 2}, 400, "invalid_sampling_width", "n"),
    ("best_of>1", "completion", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "invalid_sampling_width", "best_of"),
    ("audio-nonstream", "chat", {"model": MODEL, "messages": M, "audio": {"voice": "alloy", "format": "wav"}}, 400, "unsupported_option", "audio"),
    ("modality-nonstream", "chat", {"model": MODEL, "messages": M, "modalities": ["text", "audio"]}, 400, "unsupported_option", "modalities"),
    ("custom-tool-nonstream", "chat", {"model": MODEL, "messages": M, "tools": [{"type": "custom", "custom": {"name": "x"}}]}, 400, "unsupported_option", "tools.0.type"),
]
PATH = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_validation_row(graph: Graph, case: tuple[str, str, Any, int, str, str | None]) -> None:
    _, route, body, code_status, code, param = case
    before = counter(await status(graph.url), "invalid_requests" if code_status != 404 else "invalid_requests", code)
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        kw: dict[str, Any] = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = await c.post(PATH[route], **kw)
    assert r.status_code == code_status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["param"] == param
    assert r.headers["x-narwhal-reason"] == code and "retry-after" not in r.headers
    if code == "invalid_sampling_width":
        assert err["message"].startswith("Invalid sampling width")
    assert counter(await status(graph.url), "invalid_requests", code) == before + 1


async def test_streaming_audio_request_is_not_refused_by_the_nonstream_rule(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": M, "stream": True, "max_tokens": 2, "modalities": ["text", "audio"]})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


async def test_request_too_large_by_content_length_and_chunked(graph: Graph) -> None:
    big = b'{"model": "narwhal-sim", "prompt": "' + b"x" * 5000 + b'"}'
    async with httpx.AsyncClient(base_url=graph.tight_url, timeout=30, headers=AUTH) as c:
        r = await c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunks():  # type: ignore[no-untyped-def]
            for i in range(0, len(big), 1000):
                yield big[i : i + 1000]

        r = await c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


async def test_api_key_required_when_configured(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.tight_url, timeout=30) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "authentication_error"
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await c.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
