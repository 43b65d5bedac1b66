"""HTTP calls to engines: one streamed completion, one JSON completion.

The ``httpx.AsyncClient`` is passed in, so tests inject ``httpx.MockTransport`` and the assembler
shares one pooled client per replica (:func:`engine_client`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

import aiohttp
import httpx

# Transport errors of either HTTP stack: httpx-aiohttp maps most aiohttp errors to httpx's, not all.
TRANSPORT_ERRORS = (httpx.HTTPError, aiohttp.ClientError)


def _engine_session() -> aiohttp.ClientSession:
    # limit=0: no connection cap (aiohttp's default is 100, which httpx-aiohttp keeps otherwise)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0),
        timeout=aiohttp.ClientTimeout(total=None),
    )


def engine_client(stack: Literal["aiohttp", "httpx"] = "aiohttp") -> httpx.AsyncClient:
    """The assembler's engine client: the httpx API over aiohttp's transport (about half the CPU
    per request of plain httpx here: ``narwhal-bench transport``), or plain httpx."""
    timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
    if stack == "httpx":
        return httpx.AsyncClient(  # (the engines themselves, never through a proxy the environment names)
            timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=512), trust_env=False
        )
    from httpx_aiohttp import AiohttpTransport

    # the session is made lazily, on the loop of the replica that first uses it
    return httpx.AsyncClient(transport=AiohttpTransport(client=_engine_session), timeout=timeout)

from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.engines.sse import SSEDecoder

_DONE = b"[DONE]"
MAX_DEPTH = 128  # containers inside containers in one engine payload; deeper is malformed


def _finite(text: str) -> float:
    f = float(text)
    if f - f != 0.0:  # inf (an overflowing literal such as 1e999) or nan
        raise ValueError(f"number {text[:40]} is out of range")
    return f


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_STRICT = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


def _deeper_than(obj: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            kids: Any = v.values()
        elif isinstance(v, list):
            kids = v
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((k, depth + 1) for k in kids)
    return False


def loads_strict(data: bytes) -> Any:
    """JSON from an engine, only as the router can pass it on: valid UTF-8 and strict JSON (no NaN
    or Infinity, no number that overflows to infinity, no lone surrogate, raw or escaped), at most
    :data:`MAX_DEPTH` containers deep.  Anything else raises :class:`ValueError`.

    The checks cost next to nothing on ordinary chunks: the depth walk runs only when the payload
    has more than MAX_DEPTH brackets, the surrogate check only when it has a ``\\ud`` escape."""
    try:
        obj = _STRICT.decode(data.decode("utf-8"))  # strict UTF-8: a raw surrogate is an error
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and _deeper_than(obj, MAX_DEPTH):
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if b"\\ud" in data or b"\\uD" in data:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError on a lone surrogate
    return obj


def _retry_after(headers: httpx.Headers) -> float | None:
    """An engine's ``Retry-After`` in seconds (the delta form; an HTTP date is ignored)."""
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if 0 <= v < 86400 else None


def _http_failure(engine: str, resp_body: bytes, status: int, headers: httpx.Headers | None = None) -> EngineFailure:
    """An EngineFailure carrying the engine's own error message and param, when it sent them: in
    OpenAI's envelope (``{"error": {...}}``) or flat (``{"object": "error", "message": ...}``, as
    SGLang and older vLLM send them)."""
    msg: str | None = None
    param: str | None = None
    try:
        body = loads_strict(resp_body)
        err = body.get("error")
        if not isinstance(err, dict) and body.get("object") == "error":
            err = body
        if isinstance(err, dict):
            msg = err.get("message") if isinstance(err.get("message"), str) else None
            param = err.get("param") if isinstance(err.get("param"), str) else None
    except (ValueError, AttributeError):
        pass
    return EngineFailure(
        engine, f"HTTP {status}" + (f": {msg}" if msg else ""), status=status, upstream_message=msg, param=param,
        retry_after_s=None if headers is None else _retry_after(headers),
    )


async def stream_chunks(
    client: httpx.AsyncClient,
    engine: str,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> AsyncGenerator[list[dict[str, Any]], None]:
    """POST a streaming request; yield the parsed chunks of each network read (coalesced).

    Ends normally only after ``data: [DONE]``; a stream that closes before it, a non-200 answer or
    a payload that is not a JSON object (or is an error event) raises :class:`EngineFailure` —
    after the chunks that came before it in the same read, so that a resume continues after
    every token the engine produced, and a first token is not lost with the read it came in.
    """
    # the body is read raw (aiter_raw: no decoding on the hot path), so nothing may compress it
    req = client.build_request("POST", url, json=body, headers={**headers, "accept-encoding": "identity"})
    resp: httpx.Response | None
    try:
        resp = await client.send(req, stream=True)
    except TRANSPORT_ERRORS as exc:
        raise EngineFailure(engine, f"request failed: {type(exc).__name__}: {exc}") from None
    try:
        if resp.status_code != 200:
            try:
                raw = await resp.aread()
            except TRANSPORT_ERRORS as exc:
                raise EngineFailure(engine, f"HTTP {resp.status_code}, body broken: {type(exc).__name__}") from None
            raise _http_failure(engine, raw, resp.status_code, resp.headers)
        dec = SSEDecoder()
        done = False
        try:
            raw_reads = resp.aiter_raw()
            async for raw_chunk in raw_reads:
                batch: list[dict[str, Any]] = []
                for data in dec.feed(raw_chunk):
                    if data == _DONE:
                        done = True
                        break
                    try:
                        batch.append(_parse(engine, data))
                    except EngineFailure:
                        if batch:  # the read's good chunks first: their tokens were generated
                            yield batch
                        raise
                if batch:
                    yield batch
                if done:
                    drain_later(raw_reads, resp)
                    resp = None
                    return
            for data in dec.flush():
                if data == _DONE:
                    return
                yield [_parse(engine, data)]
        except TRANSPORT_ERRORS as exc:
            raise EngineFailure(engine, f"stream broken: {type(exc).__name__}: {exc}") from None
        raise EngineFailure(engine, "stream ended without [DONE]")
    finally:
        if resp is not None:
            await resp.aclose()


DRAIN_S = 0.5  # how long the end of a response may take to follow its `data: [DONE]`
DRAIN_BYTES = 4096


_DRAINS: set[asyncio.Task[None]] = set()


def drain_later(raw_reads: AsyncIterator[bytes], resp: httpx.Response) -> None:
    """Read the response to its end after ``[DONE]`` (normally nothing but the chunked body's
    terminator), then close it, so the connection goes back to the pool: closed at ``[DONE]``, a
    streamed request opened a new TCP connection to the engine whenever the terminator came in a
    later read.  In a task of its own (a fresh context: the request's cancellation must not cut
    it), so the stream's end is not held up; bounded in time and bytes, past either the
    connection is dropped."""

    async def run() -> None:
        left = DRAIN_BYTES
        try:
            async with asyncio.timeout(DRAIN_S):
                async for rest in raw_reads:
                    left -= len(rest)
                    if left < 0:
                        break
        except (TimeoutError, *TRANSPORT_ERRORS):
            pass
        finally:
            await resp.aclose()

    task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
    _DRAINS.add(task)
    task.add_done_callback(_DRAINS.discard)


def _parse(engine: str, data: bytes) -> dict[str, Any]:
    try:
        obj = loads_strict(data)
    except ValueError as exc:
        raise EngineFailure(engine, f"malformed SSE payload ({exc}): {data[:80]!r}") from None
    if not isinstance(obj, dict):
        raise EngineFailure(engine, "SSE payload is not a JSON object")
    choices = obj.get("choices")
    if choices is not None and not (type(choices) is list and all(type(c) is dict for c in choices)):
        raise EngineFailure(engine, "SSE payload's choices is not a list of objects")
    if obj.get("error") or ("error" in obj and "choices" not in obj):
        # (an error beside choices too: OpenRouter's mid-stream failure; the openai SDK raises on any)
        err = obj["error"]
        if isinstance(err, dict):
            code = err.get("code")
            status = code if isinstance(code, int) and not isinstance(code, bool) else None
            if isinstance(code, str) and len(code) == 3 and code.isdigit():
                status = int(code)  # (LiteLLM's proxy sends its status as a string: "429")
            msg = err.get("message") if isinstance(err.get("message"), str) else None
            param = err.get("param") if isinstance(err.get("param"), str) else None
            raise EngineFailure(engine, f"engine error event: {msg}", status=status, upstream_message=msg, param=param)
        raise EngineFailure(engine, f"engine error event: {err}")
    return obj


async def post_json(
    client: httpx.AsyncClient,
    engine: str,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> dict[str, Any]:
    """POST a non-streaming request and return its JSON object."""
    try:
        resp = await client.post(url, json=body, headers=headers)
    except TRANSPORT_ERRORS as exc:
        raise EngineFailure(engine, f"request failed: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise _http_failure(engine, resp.content, resp.status_code, resp.headers)
    try:
        obj = loads_strict(resp.content)
    except ValueError as exc:
        raise EngineFailure(engine, f"response is not JSON the router can pass on ({exc})") from None
    if not isinstance(obj, dict):
        raise EngineFailure(engine, "response is not a JSON object")
    return obj
