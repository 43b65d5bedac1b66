"""The contract's validation rows through the real graph: status, envelope, param, counter."""

from __future__ import annotations

import json
import os

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
    ("stream-options-without-stream", "completion", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "invalid_request", "stream_options"),
    ("prompt-type", "completion", {"model": MODEL, "prompt": {"a": 1}}, 400, "invalid_request", "prompt"),
    ("other-model", "chat", {"model": "gpt-4o", "messages": M}, 404, "model_not_found", "model"),
    ("n>1", "chat", {"model": MODEL, "messages": M, "n": 2}, 400, "invalid_sampling_width", "n"),
    ("best_of>1", "completion", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "invalid_sampling_width", "best_of"),
    ("prompt-batch", "completion", {"model": MODEL, "prompt": ["x", "y"]}, 400, "invalid_sampling_width", "prompt"),
    ("prompt-id-batch", "completion", {"model": MODEL, "prompt": [[1, 2], [3]]}, 400, "invalid_sampling_width", "prompt"),
    ("audio-nonstream", "chat", {"model": MODEL, "messages": M, "audio": {"voice": "alloy", "format": "wav"}}, 400, "unsupported_option", "audio"),
    ("modality-nonstream", "chat", {"model": MODEL, "messages": M, "modalities": ["text", "audio"]}, 400, "unsupported_option", "modalities"),
    ("custom-tool-nonstream", "chat", {"model": MODEL, "messages": M, "tools": [{"type": "custom", "custom": {"name": "x"}}]}, 400, "unsupported_option", "tools.0.type"),
    # what vLLM answers only in a form the router never asks for (it streams from the engine, with token IDs)
    ("echo-stream", "completion", {"model": MODEL, "prompt": "x", "echo": True, "stream": True}, 400, "unsupported_option", "echo"),
    ("echo-nonstream", "completion", {"model": MODEL, "prompt": "x", "echo": True}, 400, "unsupported_option", "echo"),
    ("chat-echo", "chat", {"model": MODEL, "messages": M, "echo": True, "stream": True}, 400, "unsupported_option", "echo"),
    ("echo-type", "chat", {"model": MODEL, "messages": M, "echo": "yes"}, 400, "invalid_request", "echo"),
    ("prompt-logprobs", "completion", {"model": MODEL, "prompt": "x", "prompt_logprobs": 2}, 400, "unsupported_option", "prompt_logprobs"),
    ("prompt-logprobs-all", "chat", {"model": MODEL, "messages": M, "prompt_logprobs": -1}, 400, "unsupported_option", "prompt_logprobs"),
    ("prompt-logprobs-type", "chat", {"model": MODEL, "messages": M, "prompt_logprobs": -2}, 400, "invalid_request", "prompt_logprobs"),
    ("beam-search", "completion", {"model": MODEL, "prompt": "x", "use_beam_search": True}, 400, "unsupported_option", "use_beam_search"),
    # what an engine or the Ray hop cannot carry is refused at parse time, never a 500
    ("nan", "chat", b'{"model": "narwhal-sim", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "invalid_request", "temperature"),
    ("infinity", "completion", b'{"model": "narwhal-sim", "prompt": "x", "top_p": -Infinity}', 400, "invalid_request", "top_p"),
    ("overflow", "completion", b'{"model": "narwhal-sim", "prompt": "x", "temperature": 1e999}', 400, "invalid_request", "temperature"),
    ("lone-surrogate-model", "chat", b'{"model": "\\ud800", "messages": []}', 400, "invalid_request", "model"),
    ("lone-surrogate-content", "chat", b'{"model": "narwhal-sim", "messages": [{"role": "user", "content": "a\\udc00b"}]}', 400, "invalid_request", "messages.0.content"),
    ("nesting-600", "chat", b'{"model": "narwhal-sim", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 600 + b"]" * 600 + b"}", 400, "invalid_request", "x" + ".0" * 63),
    ("nesting-5000", "chat", b"[" * 5000 + b"]" * 5000, 400, "invalid_request", None),
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
        if param == "prompt":  # says what to do instead, not "prompt must be 1"
            assert "a list of 2 prompts" in err["message"] and "one prompt per request" in err["message"], err
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


async def test_a_request_id_that_cannot_be_a_header_is_refused(graph: Graph) -> None:
    body = {"model": MODEL, "messages": M, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "caf\u00e9".encode()})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "x-request-id"
        r = await c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"  # present but empty
        long = "x" * 10_000  # refused; in direct ingress never echoed back whole (Narwhal's HAProxy rule:
        # Serve's proxy actor, the other run mode, echoes the header as it came)
        r = await c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": long})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
        if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "1":
            assert len(r.headers.get("x-request-id", "")) <= 128, r.headers.get("x-request-id", "")[:40]
        r = await c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "ok-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "ok-123"


@pytest.mark.parametrize("method,path,status_code,code", [("GET", "/v1/nothing", 404, "not_found"),
                                                          ("GET", "/v1/chat/completions", 405, "method_not_allowed")])
async def test_unknown_routes_and_methods_answer_in_the_envelope(graph: Graph, method: str, path: str, status_code: int, code: str) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.request(method, path)
    assert r.status_code == status_code
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code


def _raw(port: int, data: bytes) -> tuple[int, bytes]:
    """One raw HTTP/1.1 exchange (a client httpx would not let us be): status and body."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out or len(out.partition(b"\r\n\r\n")[2]) < _length(out):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _length(out: bytes) -> int:
    for line in out.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


@pytest.mark.skipif(os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "1",
                    reason="Narwhal's HAProxy rules: direct-ingress mode only")
@pytest.mark.parametrize("raw,status_code,code", [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Odd: a\x01b\r\nContent-Length: 2\r\n\r\n{}", 400, "invalid_request"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Odd: a\x1fb\r\n\r\n", 400, "invalid_request"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Odd: a\x7fb\r\n\r\n", 400, "invalid_request"),
    (b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"),
    # a method uvicorn's parser does not know (its plain-text 400 before the rule), and one it knows
    (b"get /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method_not_implemented"),
    (b"BREW /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method_not_implemented"),
    (b"PROPFIND /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method_not_implemented"),
    (b"PUT /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"),
    # a long request target (uvicorn's plain-text 400 past about 64 KiB), and one just under the bound
    (b"GET /v1/models?" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "request_target_too_long"),
    (b"POST /v1/chat/completions?" + b"a" * 66_000 + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 414,
     "request_target_too_long"),
    (b"GET /v1/nothing?" + b"a" * 64_900 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Odd: a\x00b\r\n\r\n", 400, "invalid_request"),
    # header names and request targets HAProxy's strict parser answered with its own HTML 400
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX Odd: ab\r\n\r\n", 400, "invalid_request"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX(Odd): ab\r\n\r\n", 400, "invalid_request"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX,Odd: ab\r\n\r\n", 400, "invalid_request"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-\xc3\xa9: ab\r\n\r\n", 400, "invalid_request"),
    (b"GET /v1/mod\xc3\xa9ls HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request"),
    (b'GET /v1/"models" HTTP/1.1\r\nHost: x\r\n\r\n', 400, "invalid_request"),
    (b"GET /v1/models#frag HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request"),
    (b"GET /v1/{models} HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request"),
    # ... and what stays valid: every token character in a name, every RFC 3986 character in a target
    (b"GET /v1/nothing?a=%20[b]@!$'()*+,;=:/?~._- HTTP/1.1\r\nHost: x\r\nX-$'`|~^!#%&*+._: v\r\n\r\n", 404, "not_found"),
    # oversized heads (HAProxy's own HTML 400 before the rule): 32 KB in one header, 120 headers,
    # a 100 KB Authorization
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 32_000 + b"\r\n\r\n", 431, "request_headers_too_large"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(120)) + b"\r\n", 431,
     "request_headers_too_large"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"k" * 100_000
     + b"\r\nContent-Length: 2\r\n\r\n{}", 431, "request_headers_too_large"),
    # just under the bounds: through to the router
    (b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 14_000 + b"\r\n\r\n", 404, "not_found"),
    (b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(90)) + b"\r\n", 404,
     "not_found"),
])
def test_malformed_and_oversized_heads_answer_in_the_envelope(graph: Graph, raw: bytes, status_code: int,
                                                                     code: str) -> None:
    port = int(graph.url.rsplit(":", 1)[1])
    status, body = _raw(port, raw)
    assert status == status_code, body[:200]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
