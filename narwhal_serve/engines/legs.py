"""Opening the client-facing stream of one route: a single leg, or a P/D pair (SPEC §6)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.client import post_json, stream_chunks
from narwhal_serve.engines.dialect import PATHS, Dialect
from narwhal_serve.engines.openai import OPENAI
from narwhal_serve.engines.sglang import SGLANG
from narwhal_serve.engines.vllm import VLLM
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.requests import ParsedRequest

DIALECTS: dict[str, Dialect] = {"vllm": VLLM, "sglang": SGLANG, "openai": OPENAI}


def dialect_of(engine: EngineConfig) -> Dialect:
    return DIALECTS[engine.dialect]


def _url(engine: EngineConfig, req: ParsedRequest) -> str:
    return engine.base_url + PATHS[req.route]


async def open_route(
    client: httpx.AsyncClient, route: RouteChoice, req: ParsedRequest, headers: dict[str, str]
) -> AsyncGenerator[list[dict[str, Any]], None]:
    """Yield the decode stream's chunk batches for ``route``; runs the prefill leg first for P/D."""
    decode = route.decode
    dialect = dialect_of(decode)
    if route.prefill is None:
        body = dialect.decode_body(req)
        async for batch in stream_chunks(client, decode.name, _url(decode, req), body, headers):
            yield batch
        return
    prefill = route.prefill
    if decode.dialect == "sglang":
        async for batch in _sglang_pd(client, prefill, decode, req, headers):
            yield batch
        return
    # vLLM two-step: prefill leg (non-streaming, max_tokens 1), then the decode leg carrying the
    # kv_transfer_params the prefill answer returned, verbatim.
    pre = await post_json(client, prefill.name, _url(prefill, req), VLLM.prefill_body(req), headers)
    kv = pre.get("kv_transfer_params")
    body = VLLM.decode_body(req, kv)
    async for batch in stream_chunks(client, decode.name, _url(decode, req), body, headers):
        yield batch


async def _sglang_pd(
    client: httpx.AsyncClient,
    prefill: EngineConfig,
    decode: EngineConfig,
    req: ParsedRequest,
    headers: dict[str, str],
) -> AsyncIterator[list[dict[str, Any]]]:
    boot = SGLANG.bootstrap_fields(prefill)
    pre_task = asyncio.ensure_future(
        post_json(client, prefill.name, _url(prefill, req), SGLANG.prefill_body(req, boot), headers)
    )
    try:
        body = SGLANG.decode_body(req, boot)
        async for batch in stream_chunks(client, decode.name, _url(decode, req), body, headers):
            yield batch
        await pre_task  # drain the prefill answer; its failure fails the attempt
    finally:
        if not pre_task.done():
            pre_task.cancel()
            await asyncio.gather(pre_task, return_exceptions=True)
