"""Opening the client-facing stream of one route: a single leg, or a P/D pair (docs/contract.md, "Engine dialects and token identity")."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import httpx

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.client import post_json, stream_chunks
from narwhal_serve.engines.dialect import PATHS, Dialect
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.engines.openai import OPENAI
from narwhal_serve.engines.sglang import SGLANG
from narwhal_serve.engines.vllm import VLLM
from narwhal_serve.observability import Tracing, leg_span

if TYPE_CHECKING:
    from opentelemetry.trace import Span
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.requests import ParsedRequest

DIALECTS: dict[str, Dialect] = {"vllm": VLLM, "sglang": SGLANG, "openai": OPENAI}


def dialect_of(engine: EngineConfig) -> Dialect:
    return DIALECTS[engine.dialect]


class LegCursor:
    """Which engine an open route is waiting on now (the prefill engine during a vLLM prefill
    leg, else the decode engine): a silent attempt is blamed on that one."""

    __slots__ = ("engine",)

    def __init__(self, route: RouteChoice) -> None:
        self.engine = route.decode.name


def prioritized(engine: EngineConfig, body: dict[str, Any], priority: int | None) -> dict[str, Any]:
    """``body`` with the request's class rank as ``priority`` (vLLM and SGLang: lower runs first),
    for an engine started to schedule by it; other engines refuse a non-zero priority, so they get
    none.  A client's own ``priority`` never reaches an engine (it would jump the classes' order)."""
    if priority is not None and engine.priority_scheduling and engine.dialect in ("vllm", "sglang"):
        body["priority"] = priority
    else:
        body.pop("priority", None)
    return body


def _url(engine: EngineConfig, req: ParsedRequest) -> str:
    return engine.base_url + PATHS[req.route]


async def open_route(
    client: httpx.AsyncClient,
    route: RouteChoice,
    req: ParsedRequest,
    headers: dict[str, str],
    tracing: Tracing | None = None,
    parent: "Span | None" = None,
    cursor: LegCursor | None = None,
    priority: int | None = None,
    prompt_ids: tuple[int, ...] | None = None,
) -> AsyncGenerator[list[dict[str, Any]], None]:
    """Yield the decode stream's chunk batches for ``route``; runs the prefill leg first for P/D.
    With ``tracing``, each leg runs in a span of its own, below ``parent``; ``cursor`` follows
    the leg being waited on; ``priority`` goes to engines that schedule by it; ``prompt_ids``
    (vLLM routes only): the prompt as token IDs to every leg, in place of its text."""
    decode = route.decode
    dialect = dialect_of(decode)

    def as_ids(body: dict[str, Any]) -> dict[str, Any]:
        return body if prompt_ids is None else VLLM.with_prompt_ids(body, req.route, prompt_ids)

    if route.prefill is None:
        body = prioritized(decode, as_ids(dialect.decode_body(req)), priority)
        with leg_span(tracing, parent, "narwhal.decode", decode.name, headers) as h:
            async with aclosing(stream_chunks(client, decode.name, _url(decode, req), body, h)) as chunks:
                async for batch in chunks:
                    yield batch
        return
    prefill = route.prefill
    if decode.dialect == "sglang":
        # closed as soon as this generator is: its prefill leg must not outlive the attempt
        async with aclosing(_sglang_pd(client, prefill, decode, req, headers, tracing, parent, priority, cursor)) as pd:
            async for batch in pd:
                yield batch
        return
    # vLLM two-step: prefill leg (non-streaming, max_tokens 1), then the decode leg carrying the
    # kv_transfer_params the prefill answer returned, verbatim.
    if cursor is not None:
        cursor.engine = prefill.name
    with leg_span(tracing, parent, "narwhal.prefill", prefill.name, headers) as h:
        try:
            pre = await post_json(client, prefill.name, _url(prefill, req),
                                  prioritized(prefill, as_ids(VLLM.prefill_body(req)), priority), h)
        except EngineFailure as exc:
            if not exc.client_error:
                raise
            # the engine refused the prefill leg's request (its max_tokens 1, not the client's: an
            # answer about it would misstate what the client asked): the client's own request goes
            # to the decode engine, which refuses it in the client's terms, or serves it whole
            pre = None
    if cursor is not None:
        cursor.engine = decode.name
    if pre is None:
        body = prioritized(decode, as_ids(dialect.decode_body(req)), priority)
    else:
        body = prioritized(decode, as_ids(VLLM.decode_body(req, pre.get("kv_transfer_params"))), priority)
    with leg_span(tracing, parent, "narwhal.decode", decode.name, headers) as h:
        async with aclosing(stream_chunks(client, decode.name, _url(decode, req), body, h)) as chunks:
            async for batch in chunks:
                yield batch


async def _sglang_pd(
    client: httpx.AsyncClient,
    prefill: EngineConfig,
    decode: EngineConfig,
    req: ParsedRequest,
    headers: dict[str, str],
    tracing: Tracing | None = None,
    parent: "Span | None" = None,
    priority: int | None = None,
    cursor: LegCursor | None = None,
) -> AsyncGenerator[list[dict[str, Any]], None]:
    """Both legs at once; ``cursor`` names the prefill engine while its leg is out (the decode
    engine waits on its KV: a silent attempt then, or the leg's failure, is the prefill engine's),
    the decode engine once the prefill answered."""
    boot = SGLANG.bootstrap_fields(prefill)

    async def prefill_leg() -> dict[str, Any]:
        with leg_span(tracing, parent, "narwhal.prefill", prefill.name, headers) as h:
            return await post_json(client, prefill.name, _url(prefill, req),
                                   prioritized(prefill, SGLANG.prefill_body(req, boot), priority), h)

    pre_task = asyncio.ensure_future(prefill_leg())
    if cursor is not None:
        cursor.engine = prefill.name

        def answered(t: "asyncio.Future[dict[str, Any]]") -> None:
            if not t.cancelled() and t.exception() is None:
                cursor.engine = decode.name

        pre_task.add_done_callback(answered)
    try:
        body = prioritized(decode, SGLANG.decode_body(req, boot), priority)
        with leg_span(tracing, parent, "narwhal.decode", decode.name, headers) as h:
            async with aclosing(stream_chunks(client, decode.name, _url(decode, req), body, h)) as chunks:
                async for batch in _until_prefill_fails(chunks, pre_task):
                    yield batch
        await pre_task  # drain the prefill answer; its failure fails the attempt
    finally:
        if not pre_task.done():
            pre_task.cancel()
        await asyncio.gather(pre_task, return_exceptions=True)  # (its failure retrieved, whatever ended the attempt)


async def _until_prefill_fails(
    chunks: AsyncGenerator[list[dict[str, Any]], None], pre_task: "asyncio.Future[dict[str, Any]]",
) -> AsyncGenerator[list[dict[str, Any]], None]:
    """The decode leg's batches; while the prefill leg is out, its failure ends them at once (raised,
    charged to the prefill engine): SGLang's decode engine would wait for KV that never comes, up to
    its own disaggregation timeout (300 s by default)."""
    it = chunks.__aiter__()
    while True:
        if pre_task.done():
            if not pre_task.cancelled() and pre_task.exception() is not None:
                await pre_task  # (it failed while a batch was out, or as one came in: raised now)
            try:
                batch = await it.__anext__()
            except StopAsyncIteration:
                return
        else:
            nxt = asyncio.ensure_future(it.__anext__())
            try:
                await asyncio.wait((nxt, pre_task), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done() and pre_task.exception() is not None:
                    await pre_task  # (raises the prefill leg's failure)
                batch = await nxt
            except StopAsyncIteration:
                return
            finally:
                if not nxt.done():  # the prefill leg failed first, or this generator is cancelled
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
        yield batch
