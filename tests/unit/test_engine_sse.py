"""Review of how the engine client reads Server-Sent Events (WHATWG HTML, "Server-sent events",
§9.2.5-9.2.6) against what real OpenAI-compatible servers send.  Each test is a stream a real server
(or the spec) produces that ``stream_chunks`` misread before its fix."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from narwhal_serve.engines.client import stream_chunks
from narwhal_serve.engines.errors import EngineFailure

TOKEN = b'{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}'


def _fixed(body: bytes, headers: dict[str, str] | None = None) -> Callable[[httpx.Request], httpx.Response]:
    hdrs = {"content-type": "text/event-stream", **(headers or {})}
    return lambda r: httpx.Response(200, headers=hdrs, stream=httpx.ByteStream(body))


async def _chunks(handler: Callable[[httpx.Request], httpx.Response]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        return [ch async for batch in stream_chunks(c, "e", "http://e/v1/chat/completions", {}, {}) for ch in batch]


# 1. llama.cpp's server (examples/server/server.cpp, handle_completions_impl, builds of early/mid 2025)
#    sends a streaming failure as a non-standard `error:` field, then `data: [DONE]`:
#        server_sent_event(sink, "error", error_data);  ...  "data: [DONE]\n\n"
#    The decoder ignores the unknown field (as the spec says for *display*, but it is the engine's only
#    failure signal), so the stream "ends normally": a 200 with no tokens (or a truncated answer).
LLAMACPP_ERROR = (b'error: {"code":400,"message":"the request exceeds the available context size, '
                  b'try increasing it","type":"exceed_context_size_error"}\n\n')


@pytest.mark.parametrize("before", [b"", b"data: " + TOKEN + b"\n\n"], ids=["before-first-token", "mid-stream"])
async def test_llamacpp_error_field_is_an_engine_failure(before: bytes) -> None:
    with pytest.raises(EngineFailure):
        await _chunks(_fixed(before + LLAMACPP_ERROR + b"data: [DONE]\n\n"))


# 2. LiteLLM proxy's mid-stream error (litellm/proxy/proxy_server.py async_data_generator):
#        yield f"data: {json.dumps({'error': proxy_exception.to_dict()})}\n\n"
#    with ProxyException.code = str(code) (litellm/proxy/_types.py: "the code should be a string") — so
#    a 400 (bad request) or 429 ("No deployments available" is forced to "429") arrives as a string
#    and is read as status None: retried on every engine and answered 502, or counted as a fault
#    instead of backpressure.
@pytest.mark.parametrize("code,kind", [("400", "client_error"), ("429", "backpressure")])
async def test_litellm_string_status_code_in_error_event_is_read(code: str, kind: str) -> None:
    body = (b'data: {"error": {"message": "upstream said no", "type": "None", "param": "None", "code": "'
            + code.encode() + b'"}}\n\n')
    with pytest.raises(EngineFailure) as info:
        await _chunks(_fixed(body))
    assert getattr(info.value, kind), f"code {code!r} read as status {info.value.status!r}"


# 3. An error object beside `choices` (OpenRouter's documented mid-stream error: a chunk with
#    "error": {...} and choices[0].finish_reason "error", then [DONE]).  The official openai SDK raises
#    APIError on any chunk whose "error" is truthy (openai/_streaming.py: `data.get("error")`); Narwhal
#    only when "choices" is absent, so the failed generation is relayed as a successful answer.
async def test_error_beside_choices_is_an_engine_failure() -> None:
    failed = (b'{"id": "gen-1", "object": "chat.completion.chunk", "error": {"code": 502, "message": '
              b'"Provider disconnected unexpectedly"}, "choices": [{"index": 0, "delta": {"content": ""}, '
              b'"finish_reason": "error"}]}')
    body = b"data: " + TOKEN + b"\n\ndata: " + failed + b"\n\ndata: [DONE]\n\n"
    with pytest.raises(EngineFailure):
        await _chunks(_fixed(body))


# 4. httpx sends `Accept-Encoding: gzip, deflate` by default (and httpx_aiohttp forwards it with
#    auto_decompress=False), but stream_chunks reads `resp.aiter_raw()`, i.e. the still-encoded body.
#    A server or proxy that honours the header (nginx `gzip_types text/event-stream`, a compressing
#    CDN, an older Starlette GZipMiddleware) makes every stream unreadable: "ended without [DONE]".
async def test_a_stream_compressed_as_the_router_asked_is_read() -> None:
    plain = b"data: " + TOKEN + b"\n\ndata: [DONE]\n\n"

    def handler(req: httpx.Request) -> httpx.Response:
        if "gzip" in req.headers.get("accept-encoding", ""):
            return _fixed(gzip.compress(plain), {"content-encoding": "gzip"})(req)
        return _fixed(plain)(req)

    assert len(await _chunks(handler)) == 1


# 5. Spec (§9.2.6, "Event stream interpretation"): the stream is UTF-8-decoded, so one leading
#    U+FEFF BOM is dropped.  Here the BOM glues onto the first line, `\xef\xbb\xbfdata:` is not a data
#    field, and the first event (vLLM's role chunk with prompt_token_ids; or a first token) is lost
#    silently.  No server reviewed sends a BOM; a spec conformance gap with silent data loss.
async def test_a_leading_bom_does_not_drop_the_first_event() -> None:
    body = b"\xef\xbb\xbfdata: " + TOKEN + b"\n\ndata: [DONE]\n\n"
    assert len(await _chunks(_fixed(body))) == 1


# 6. Spec (§9.2.5 ABNF: end-of-line = ( cr lf / cr / lf )): a bare CR ends a line.  The decoder
#    splits on LF only, so a CR-only stream is held whole until EOF, then read as one malformed
#    payload.  No server reviewed sends CR-only; a spec conformance gap.
async def test_cr_only_line_endings_are_line_endings() -> None:
    body = b"data: " + TOKEN + b"\r\rdata: [DONE]\r\r"
    assert len(await _chunks(_fixed(body))) == 1
