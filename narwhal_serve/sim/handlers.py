"""``/v1/chat/completions`` and ``/v1/completions``: validation, P/D legs, faults, SSE."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from narwhal_serve.sim.chunks import (
    Shape,
    chat_response,
    chat_role_chunk,
    chat_step_chunk,
    completion_response,
    completion_step_chunk,
    usage_chunk,
    with_running_usage,
)
from narwhal_serve.protocol.sse import DONE_EVENT, sse_event
from narwhal_serve.sim.engine import Engine, Job
from narwhal_serve.sim.faults import ERROR_EVENT, MALFORMED_EVENT, FaultPlan, SimulatedReset, corrupt_body, corrupt_stream_choice
from narwhal_serve.sim.reqparse import (
    ChatRequest,
    CompletionRequest,
    SimError,
    bad_request,
    check_before,
    check_sampling,
    check_sim_ext,
    vllm_error,
    error_response,
    parse_body,
)
from narwhal_serve.sim.scripts import Output, build_output
from narwhal_serve.sim.textgen import encode_prompt, generate, render_chat, request_rng_seed, stable_hash

logger = logging.getLogger(__name__)
Kind = Literal["chat", "completion"]
_STREAM_FAULTS = ("hang_mid_stream", "reset_mid_stream", "malformed_sse", "error_mid_stream")
# Answers of an overloaded engine (or a gateway in front of one): the envelope and a Retry-After.
BUSY_FAULTS = ((429, "error_429", "RateLimitError"), (503, "error_503", "ServiceUnavailableError"))


def fingerprint(name: str) -> str:
    return f"vllm-0.32.0-{stable_hash('fingerprint', name) & 0xFFFFFFFF:08x}"


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise SimError(400, f"JSON decode error: {exc}", "Bad Request", "body") from None


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_disconnect(request: Request, engine: Engine) -> None:
    """Block until the client goes away (or the app shuts down) without sending anything."""
    tasks = {asyncio.ensure_future(_client_gone(request)), asyncio.ensure_future(engine.stall())}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Prepared:
    shape: Shape
    output: Output
    prompt_ids: list[int]
    stream: bool
    skip_prefill: bool
    prefill_leg: bool
    plan: FaultPlan
    request_id: str
    priority: int = 0


def _completion_prompt(prompt: str | list[str] | list[int] | list[list[int]], special: bool) -> list[int]:
    if isinstance(prompt, str):
        return encode_prompt(prompt, special)
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return encode_prompt(prompt[0], special)
    if len(prompt) == 1 and isinstance(prompt[0], list):
        return list(prompt[0])
    if prompt and all(isinstance(t, int) for t in prompt):
        return [t for t in prompt if isinstance(t, int)]
    raise bad_request("the simulator serves exactly one prompt per request", "prompt")


COMPLETION_DEFAULT = 16  # vLLM's CompletionRequest.max_tokens default


def _reused_prompt_ids(req: ChatRequest) -> list[int] | None:
    """A chat's prompt forwarded as token IDs (``kv_transfer_params.prompt_token_ids``), as vLLM
    0.32's ``_reused_prompt_token_ids`` takes it: out of the params, ignored when ``echo`` is set or
    a message has non-text content (those render the messages), else checked and used unrendered."""
    kvp = req.kv_transfer_params
    if not isinstance(kvp, dict):
        return None
    ids = kvp.pop("prompt_token_ids", None)
    if ids is None or getattr(req, "echo", False):
        return None
    if any(isinstance(m.content, list) and any(p.get("type") != "text" for p in m.content) for m in req.messages):
        return None
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise vllm_error("`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative "
                          "integers.", "kv_transfer_params.prompt_token_ids")
    return ids


def _truncated(prompt_ids: list[int], req: ChatRequest | CompletionRequest, limit: int) -> list[int]:
    """The prompt as vLLM 0.32 keeps it under ``truncate_prompt_tokens`` (renderers/params.py):
    at most the context; -1 is the context less one, 0 none (refused: an empty prompt); the last
    tokens kept unless ``truncation_side`` is ``right`` (a generating model's tokenizer truncates
    on the left)."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep > limit:
        raise bad_request(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {limit}. Please "
                          f"request a smaller truncation size. (parameter=truncate_prompt_tokens, value={keep})",
                          "truncate_prompt_tokens")
    keep = limit - 1 if keep < 0 else keep
    if not keep:
        raise bad_request("The decoder prompt cannot be empty")
    if keep >= len(prompt_ids):
        return prompt_ids
    return prompt_ids[:keep] if req.truncation_side == "right" else prompt_ids[len(prompt_ids) - keep:]


def prepare(engine: Engine, raw: Any, kind: Kind, x_request_id: str | None) -> Prepared:
    cfg = engine.cfg
    req: ChatRequest | CompletionRequest
    check_before(raw, kind)
    if kind == "chat":
        req = parse_body(ChatRequest, raw)
        reused = _reused_prompt_ids(req) if cfg.dialect == "vllm" else None
        prompt_ids = reused if reused is not None else render_chat(
            [(m.role, m.text()) for m in req.messages], req.add_generation_prompt)
    else:
        req = parse_body(CompletionRequest, raw)
    check_sim_ext(req.sim)
    if req.model is not None and req.model != cfg.model:
        raise SimError(404, f"The model `{req.model}` does not exist. Valid aliases: {cfg.model}.",
                       "NotFoundError", "model")
    if req.n != 1:
        raise bad_request("n > 1 is not supported by the simulator", "n")
    if req.priority != 0 and not cfg.priority_scheduling:  # vLLM's own answer
        raise bad_request(f"Got priority {req.priority} but Priority scheduling is not enabled.", "priority")
    if isinstance(req, CompletionRequest):
        prompt_ids = _completion_prompt(req.prompt, req.add_special_tokens)
    limit = cfg.max_model_len
    asked = req.max_completion_tokens if isinstance(req, ChatRequest) else None
    param = "max_completion_tokens" if asked is not None else "max_tokens"
    asked = asked if asked is not None else req.max_tokens
    if asked is not None and asked > limit:
        raise bad_request(f"{param}={asked} cannot be greater than max_model_len={limit}. Please request fewer "
                          f"output tokens. (parameter={param}, value={asked})", param)
    prompt_ids = _truncated(prompt_ids, req, limit)
    n_prompt = len(prompt_ids)
    if n_prompt > limit:  # vLLM 0.32's renderer (a text prompt is tokenized up to one token past the limit)
        # (a completion's prompt is one of _completion_prompt's forms: text, [text], IDs or [IDs])
        text = isinstance(req, ChatRequest) or isinstance(req.prompt, str) or isinstance(req.prompt[0], str)
        shown = min(n_prompt, limit + 1) if text else n_prompt
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                          f"{'at least ' if shown == limit + 1 else ''}{shown} input tokens, which exceeds this limit "
                          f"even without any output tokens. Please reduce the length of the input prompt. "
                          f"(parameter=input_tokens, value={shown})", "input_tokens")
    # vLLM's get_max_tokens: what is asked, within the context left (a longer ask is cut to it, not
    # refused); unasked, the context left for a chat or a completion's explicit ``null``, 16 tokens
    # for a completion without the field (its request model's default).  Up to the context, it then
    # runs to ``default_max_tokens`` at most (the simulator's stand-in for a model that stops by
    # itself: its last token an EOS, ``stop``; vLLM says ``length`` only at max_tokens or the
    # context), past ``min_tokens``.
    room = limit - n_prompt
    to_context = asked is None and (isinstance(req, ChatRequest) or "max_tokens" in req.model_fields_set)
    max_tokens = min(asked, room) if asked is not None else room if to_context else min(COMPLETION_DEFAULT, room)
    check_sampling(req, max_tokens)
    ends_itself = False
    if to_context and (natural := max(cfg.default_max_tokens, req.min_tokens + 1)) <= max_tokens:
        max_tokens, ends_itself = natural, True
    sim = req.sim
    plan = FaultPlan.of(cfg.faults, sim.faults() if sim else [], sim.fault_after if sim else 2)

    stream = bool(req.stream)
    kvp = req.kv_transfer_params or {}
    if cfg.dialect == "vllm":
        prefill_leg = kvp.get("do_remote_decode") is True
        skip_prefill = kvp.get("do_remote_prefill") is True
    else:
        prefill_leg = cfg.dialect == "sglang" and cfg.role == "prefill"
        skip_prefill = cfg.dialect == "sglang" and cfg.role == "decode" and req.bootstrap_room is not None
    if prefill_leg and cfg.dialect == "sglang":
        stream, max_tokens = False, 1

    if isinstance(req, ChatRequest):
        k = (req.top_logprobs or 0) if req.logprobs else None
    else:
        k = req.logprobs
    rng_seed = request_rng_seed(cfg.seed, req.seed, prompt_ids)
    greedy = req.temperature == 0
    gen = generate(rng_seed, max_tokens=max_tokens, min_tokens=min(req.min_tokens, max_tokens),
                   stop=req.stop_list(), ignore_eos=req.ignore_eos, eos_prob=cfg.eos_prob, num_top=k or 0,
                   context=prompt_ids if greedy else None, include_stop=req.include_stop_str_in_output,
                   ends_itself=ends_itself)
    script = sim.script if sim else None
    if kind == "chat" and script is None and plan.has("tool_call_no_id"):
        script = "tool_calls"
    output = build_output(script if kind == "chat" else None, gen, rng_seed, k or 0,
                          tool_ids=not plan.has("tool_call_no_id"))

    request_id = x_request_id or secrets.token_hex(8)
    shape = Shape(
        kind=kind,
        rid=("chatcmpl-" if kind == "chat" else "cmpl-") + request_id,
        created=int(time.time()),
        model=cfg.model,
        fingerprint=fingerprint(cfg.name),
        prompt_ids=prompt_ids,
        want_ids=cfg.dialect != "openai" and bool(req.return_token_ids),
        logprobs=k,
        include_usage=req.include_usage() and not plan.has("missing_usage"),
        dialect=cfg.dialect,
        continuous_usage=req.continuous_usage() and not plan.has("missing_usage"),
        holdback=max(map(len, stops)) - 1 if (stops := req.stop_list()) and not req.include_stop_str_in_output else 0,
    )
    return Prepared(shape, output, prompt_ids, stream, skip_prefill, prefill_leg, plan, request_id, req.priority)


async def handle_generate(engine: Engine, request: Request, kind: Kind) -> Response:
    x_request_id = request.headers.get("x-request-id")
    try:
        raw = await read_json(request)
    except SimError as exc:
        engine.record(request.url.path, x_request_id, None, request.headers.get("traceparent"))
        return exc.response()
    engine.record(request.url.path, x_request_id, raw, request.headers.get("traceparent"))
    logger.debug("%s %s X-Request-Id=%s", engine.cfg.name, request.url.path, x_request_id)
    try:
        prep = prepare(engine, raw, kind, x_request_id)
    except SimError as exc:
        return exc.response()
    plan = prep.plan
    if plan.has("error_500"):
        return error_response(500, "Simulated engine failure (fault error_500)", "InternalServerError")
    for status, name, type_ in BUSY_FAULTS:  # backpressure: the engine is busy, come back later
        if plan.has(name):
            return error_response(status, f"Simulated engine busy (fault {name})", type_,
                                  headers={"Retry-After": str(engine.cfg.retry_after_s)})
    if plan.has("hang") or (plan.has("hang_mid_stream") and not prep.stream):
        await wait_disconnect(request, engine)
        return Response(status_code=503)
    job = Job(prep.prompt_ids, prep.output, skip_prefill=prep.skip_prefill, priority=prep.priority)
    headers = {"X-Request-Id": prep.request_id}
    if prep.stream:
        return StreamingResponse(_sse(engine, prep, job), media_type="text/event-stream", headers=headers)

    if not await _ran(engine, job, request):
        return Response(status_code=499)  # (nobody reads it)
    kvp: dict[str, Any] | None = None
    if prep.prefill_leg and engine.cfg.dialect == "vllm":
        kvp = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine.cfg.name,
               "remote_block_ids": job.block_ids, "remote_host": "127.0.0.1", "remote_port": engine.port,
               "tp_size": 1, "request_id": prep.request_id}
    build = chat_response if kind == "chat" else completion_response
    body = build(prep.shape, prep.output, kvp)
    corrupt_body(body, plan, len(prep.output.steps), kind == "chat")
    if plan.has("malformed_sse"):
        return Response(b"{not json", media_type="application/json", headers=headers)
    if plan.has("reset_mid_stream"):
        data = json.dumps(body).encode()
        return StreamingResponse(_partial(data[: len(data) // 2]), media_type="application/json", headers=headers)
    return JSONResponse(body, headers=headers)


async def _ran(engine: Engine, job: Job, request: Request) -> bool:
    """A non-streaming request run to its end — or until its client leaves, when it is aborted and
    its slot freed at once, as vLLM 0.32's handlers are (``with_cancellation``): whether it ended."""

    async def run() -> None:
        async with aclosing(engine.run(job)) as steps:
            async for _ in steps:
                pass

    work, gone = asyncio.ensure_future(run()), asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, gone):
            t.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    if work.cancelled():
        return False
    work.result()  # (its failure, raised)
    return True


async def _partial(data: bytes) -> AsyncIterator[bytes]:
    yield data
    raise SimulatedReset("simulated connection reset (non-stream)")


class _StreamFault:
    """Fires the request's stream fault once ``after`` events went out (or just before ``[DONE]``)."""

    def __init__(self, engine: Engine, plan: FaultPlan) -> None:
        self.engine, self.plan = engine, plan
        self.fired = not any(plan.has(n) for n in _STREAM_FAULTS)

    async def before(self, sent: int, at_end: bool) -> bytes:
        if self.fired or not (at_end or sent >= self.plan.after):
            return b""
        self.fired = True
        if self.plan.has("hang_mid_stream"):
            await self.engine.stall()
            raise SimulatedReset("simulator shutting down during hang_mid_stream")
        if self.plan.has("reset_mid_stream"):
            raise SimulatedReset("simulated connection reset mid-stream")
        if self.plan.has("error_mid_stream"):
            return ERROR_EVENT
        return MALFORMED_EVENT


async def _events(engine: Engine, prep: Prepared, job: Job) -> AsyncGenerator[dict[str, Any], None]:
    sh, plan, out = prep.shape, prep.plan, prep.output
    chat = sh.kind == "chat"
    if chat:
        yield with_running_usage(sh, chat_role_chunk(sh), 0)
    n, target, offset = len(out.steps), plan.token_target(len(out.steps)), 0
    text, shown = "", 0  # the content so far, and how much of it went out
    async with aclosing(engine.run(job)) as steps:
        i = 0
        async for step in steps:
            finish = (out.finish_reason, out.stop_reason) if i == n - 1 else None
            sent = step
            if sh.holdback and step.kind == "content":  # (what may begin a stop string waits)
                text += step.text
                upto = len(text) if finish else len(text) - sh.holdback
                sent = dataclasses.replace(step, text=text[shown:upto] if upto > shown else "")
                shown = max(shown, upto)
            if chat:
                obj = chat_step_chunk(sh, sent, finish)
            else:
                obj = completion_step_chunk(sh, sent, i == 0, offset, finish)
                offset += len(step.text)
            corrupt_stream_choice(obj["choices"][0], plan, i == target, chat)
            yield with_running_usage(sh, obj, i + 1)
            i += 1
    if sh.include_usage:
        yield usage_chunk(sh, n)


async def _sse(engine: Engine, prep: Prepared, job: Job) -> AsyncIterator[bytes]:
    gate = _StreamFault(engine, prep.plan)
    sent = 0
    async with aclosing(_events(engine, prep, job)) as events:
        async for obj in events:
            pre = await gate.before(sent, at_end=False)
            if pre:
                yield pre
                if pre is ERROR_EVENT:
                    yield DONE_EVENT
                    return
            yield sse_event(obj)
            sent += 1
    pre = await gate.before(sent, at_end=True)
    if pre:
        yield pre
    yield DONE_EVENT
