"""The assembler's work for one placed request: try candidate routes until one answers, then relay
its stream (streaming clients) or fold it into one response (non-streaming clients).

Before response headers a failed attempt (engine error, broken stream, bad token IDs) moves on to
the next candidate while the deadline allows.  After the first token a failure is resumed on another
engine where that can be exact (``relay/resuming.py``, docs/contract.md, "Engine failures"); otherwise the stream
ends with one error event and ``[DONE]`` (docs/contract.md, "Errors") — never a silent truncation.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import httpx

from narwhal_serve.assembly.exposure import expose
from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.config import EngineConfig, ObservabilityConfig, ServingConfig
from narwhal_serve.engines.client import engine_client
from narwhal_serve.engines.errors import EngineFailure
from narwhal_serve.engines.legs import dialect_of, open_route
from narwhal_serve.errors import BadEngineResponse, InvalidRequest, TerminalExpiry
from narwhal_serve.observability import Tracing, end_span
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.protocol.requests import forces_tool, hides_reasoning
from narwhal_serve.protocol.sse import DONE_EVENT, error_events, sse_event
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.attempt import (
    Attempt,
    DeadlinePassed,
    Meter,
    UsageWatch,
    attempt_span,
    backpressure_refusal,
    deadline_info,
    faults_of,
)
from narwhal_serve.relay.coalesce import coalesce
from narwhal_serve.relay.messages import EngineFault, EngineWorked, RelayMessage
from narwhal_serve.relay.resuming import ResumingReads
from narwhal_serve.tokenization.forward import ForwardMode, PromptIdForwarding

if TYPE_CHECKING:
    from opentelemetry.trace import Span



class Relay(ResumingReads):
    """Runs one placed request. ``clock`` is wall time (deadlines cross processes).

    Every read from an engine is bounded: by ``idle_timeout_s`` (an engine silent that long fails
    the attempt — another route before headers, an error event after), before the first token by
    the request's first-token limit when another route is left to try, and by the request's
    deadline, which holds for the whole request (docs/configuration.md, "Configuration"): past it, 504 before headers, an error
    event ``deadline_expired`` and ``[DONE]`` after.  Failed attempts and each attempt's first token
    travel to the scheduler in order, as ``EngineFault`` and ``EngineWorked`` health events on the
    next message (passive health)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        clock: Callable[[], float] = time.time,
        *,
        idle_timeout_s: float = 60.0,
        tracing: Tracing | None = None,
        coalesce_reads: bool = True,
        max_resumes: int = 1,
        resume_first_token_s: float = 10.0,
        forward_prompt_ids: ForwardMode = "completions",
    ) -> None:
        self.client = client
        self.forwarding = PromptIdForwarding(forward_prompt_ids)
        self.clock = clock
        self.idle_timeout_s = idle_timeout_s
        self.max_resumes = max_resumes  # continuations per request after its first token (0: none)
        # the engines eligible now for a continuation of this many tokens (their context holds it),
        # least loaded first (the ingress's lease view); None, or nothing there: the request's own
        # candidate routes
        self.live_targets: Callable[[int], list[EngineConfig]] | None = None
        self.live_context: Callable[[str], int | None] | None = None
        # the served model's tokenizer's decode, where the router has one: where a cut character
        # starts when the engine sent several tokens in a chunk (resume.Transcript.settle)
        self.detokenize: Callable[[list[int]], str] | None = None
        self.resume_first_token_s = resume_first_token_s  # a continuation's first token must come within this
        # merge the engine reads that piled up into one message: for a Ray hop (the Assembler
        # shape); in the ingress the SSE response's own reader buffers ahead of the client
        self.coalesce_reads = coalesce_reads
        self.tracing = tracing if tracing is not None and tracing.on else None
        self._active: dict[Attempt, PlacedRequest] = {}  # answers being relayed (cut_engine)

    @classmethod
    def configured(cls, client: httpx.AsyncClient, serving: ServingConfig, observability: ObservabilityConfig,
                   *, coalesce_reads: bool = True) -> "Relay":
        """A relay over ``client`` with the serving and observability settings that concern it."""
        return cls(client, idle_timeout_s=serving.engine_idle_timeout_s, tracing=Tracing(observability),
                   coalesce_reads=coalesce_reads, max_resumes=serving.max_resumes,
                   resume_first_token_s=serving.resume_first_token_s, forward_prompt_ids=serving.forward_prompt_ids)

    async def run(self, placed: PlacedRequest) -> AsyncIterator[RelayMessage]:
        failures: list[str] = []
        faults: list[EngineFault] = []  # failed attempts not yet sent to the ingress
        pushed_back: list[float | None] = []  # the Retry-After of each route that answered 429/503
        expired = False
        req = placed.request
        headers = {"X-Request-Id": placed.request_id}
        if placed.epoch:
            headers["X-Narwhal-Epoch"] = str(placed.epoch)  # the fencing token (docs/operations.md, "Running two routers")
        last = len(placed.candidates)
        excluded: set[str] = set()  # engines that failed this request
        tried = 0  # routes tried
        for attempt, route in enumerate(placed.candidates, start=1):
            if self.clock() >= placed.deadline:
                break
            if excluded.intersection(route.engines):
                continue  # an engine of this route failed this request already (a continuation's)
            at = Attempt(
                route, attempt, Meter(self.clock(), dialect_of(route.decode).supports_token_ids and not hides_reasoning(req),
                                      req.route,
                                          placed.received),
                placed.first_token_s if attempt < last else None,  # the last route waits to the deadline
                req, excluded,
            )
            tried += 1
            span = attempt_span(self.tracing, placed, route, attempt)
            failed: str | None = None
            self._active[at] = placed
            try:
                work = self._stream if req.stream else self._assemble
                async for msg in work(placed, at, headers, span):
                    if msg.error is not None:
                        failed = msg.error.code
                    if faults and (msg.data or msg.first_token or msg.final):
                        msg = replace(msg, health=(*faults, *msg.health))
                        faults.clear()
                    yield msg
                return
            except EngineFailure as exc:
                failed = str(exc)
                if exc.client_error and not at.resumes:  # the engine blames the request: no other engine will differ
                    why = exc.upstream_message or exc.message
                    rejected = InvalidRequest(f"The engine rejected the request: {why}", param=exc.param)
                    yield RelayMessage(error=rejected.info(), final=True, health=tuple(faults),
                                       stats=RelayStats.before_headers(route.engines, attempt))
                    return
                if not exc.client_error:  # (a continuation the router built, refused: no engine's fault)
                    faults.extend(faults_of(exc, at.route))
                failures.append(str(exc))
                excluded.add(at.cursor.engine)
                if exc.status is None:  # not reached: it may come back as another engine
                    self.forwarding.forget(at.cursor.engine)
                if exc.backpressure:
                    pushed_back.append(exc.retry_after_s)
            except BadEngineResponse as exc:
                failed = str(exc)
                faults.extend(faults_of(exc, at.route))
                failures.append(str(exc))
                excluded.add(at.cursor.engine)
            except DeadlinePassed:
                failed = "deadline_expired"
                expired = True
                limit = placed.first_token_s
                if at.meter.first is None and limit is not None and self.clock() - at.meter.start >= limit:
                    faults.append(EngineFault(at.cursor.engine, "timeout", "no first token before the deadline"))
                break
            finally:
                del self._active[at]
                end_span(span, failed, **{"narwhal.output_tokens": at.meter.tokens})
        if expired or self.clock() >= placed.deadline:
            err = TerminalExpiry(
                "terminal expiry: the request deadline passed before response headers", code="deadline_expired"
            ).info()
        elif failures and len(pushed_back) == len(failures):
            err = backpressure_refusal(pushed_back, failures)
        else:
            err = BadEngineResponse(
                "no engine produced a usable answer: " + "; ".join(failures or ["no candidate route"])
            ).info()
        yield RelayMessage(error=err, final=True, stats=RelayStats.before_headers((), tried), health=tuple(faults))

    async def _validated(
        self, stream: AsyncIterator[list[dict[str, Any]]], placed: PlacedRequest, at: Attempt
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """``stream``'s batches, checked (:meth:`Attempt.checked`); a bad chunk ends the batch."""
        async for batch in self._batches(stream, placed, at):
            good, bad = at.checked(batch, self.clock())
            if at.meter.first is not None and at.wait_from is not None:
                at.wait_from = None
                at.health.append(EngineWorked(at.route.engines))  # the route produced a first token
                if at.prompt_ids is None:  # sent as text: did the engine read the prompt as the router did?
                    self.forwarding.observed(at.route.decode.name, placed.request_id, placed.request,
                                             at.transcript.prompt_ids, self.clock())
            if bad is None or (good and at.meter.first is not None):
                yield good
            if bad is not None:
                raise bad

    async def _chunks(
        self, placed: PlacedRequest, at: Attempt, headers: dict[str, str], span: "Span | None"
    ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The answer's checked chunk batches in the client's route: the route's stream, then,
        when it fails after the first token, continuations on other engines (docs/contract.md,
        "Engine failures (passive health)").  Raises what ended it when it cannot go on."""
        req = placed.request
        route = at.route
        takes_ids = all(dialect_of(e).takes_prompt_ids for e in (route.prefill, route.decode) if e is not None)
        at.prompt_ids = self.forwarding.choose(route.decode.name, takes_ids, req, self.clock())
        stream = open_route(self.client, route, req, headers, self.tracing, span, at.cursor, placed.priority,
                            at.prompt_ids)
        if self.coalesce_reads:
            stream = coalesce(stream)
        try:
            async for batch in self._validated(stream, placed, at):
                yield batch
            return
        except (EngineFailure, BadEngineResponse) as exc:
            if at.meter.first is None:
                raise
            failure: EngineFailure | BadEngineResponse = exc
            at.cut_at = self.clock()
        finally:
            await stream.aclose()
        while True:
            nxt: EngineFailure | BadEngineResponse | None = None
            async with aclosing(self._resume(placed, at, headers, failure, span)) as cont:
                async for batch in cont:
                    if isinstance(batch, (EngineFailure, BadEngineResponse)):
                        nxt = batch  # the continuation failed after its first token: the next cut
                        at.cut_at = self.clock()
                        break
                    yield batch
            if nxt is None:
                return
            failure = nxt

    async def _stream(
        self, placed: PlacedRequest, at: Attempt, headers: dict[str, str], span: "Span | None"
    ) -> AsyncIterator[RelayMessage]:
        req = placed.request
        meter = at.meter
        committed = False
        held: list[bytes] = []  # chunks before the first generated token (e.g. the role chunk)
        usage = UsageWatch(req.prompt_tokens)
        bare = req.route == "chat" and not req.return_token_ids
        usage_sent = False  # the engine's usage chunk is in what went to the client
        chunks = self._chunks(placed, at, headers, span)
        try:
            async for batch in chunks:
                for chunk in batch:
                    usage.observe(chunk)
                    if "model" in chunk:
                        chunk["model"] = placed.model
                    if not chunk.get("choices") and "usage" in chunk:
                        if not req.include_usage:
                            continue  # the router asked for usage; this client did not
                        usage_sent = True
                    if bare and ids_only(chunk):
                        continue  # the router asked for token IDs; this client did not
                    if not req.include_usage:
                        chunk.pop("usage", None)
                    held.append(sse_event(expose(chunk, return_token_ids=req.return_token_ids)))
                # Response headers go out with the first generated token, so that a failure up to
                # and including it can still be retried on another route.
                if held and (committed or meter.first is not None) or committed and (at.notes or at.moved):
                    first = not committed
                    committed = True
                    meta = ({**usage.meta, "model": placed.model}, usage.prompt_tokens) if first and req.include_usage else None
                    yield RelayMessage(data=b"".join(held), first_token=first, tokens=meter.tokens, usage_meta=meta,
                                       usage_sent=usage_sent, **{"engines": at.route.engines, **at.news()})
                    held = []
        except (EngineFailure, BadEngineResponse, DeadlinePassed) as exc:
            if not committed:
                raise
            if isinstance(exc, DeadlinePassed):
                err = deadline_info()
                faults: tuple[EngineFault, ...] = ()
            else:
                err = exc.info() if isinstance(exc, BadEngineResponse) else BadEngineResponse(str(exc)).info()
                # (a 4xx here refused a continuation the router built: no engine's fault)
                faults = () if isinstance(exc, EngineFailure) and exc.client_error else faults_of(exc, at.route)
            news = at.news()
            news["health"] = (*news.get("health", ()), *faults)
            if req.include_usage and not usage.seen:  # what it got before the error, counted
                held.append(sse_event(usage.chunk(placed.model, meter.tokens)))
            yield RelayMessage(data=b"".join(held) + error_events(err), error=err, final=True, stats=at.stats(),
                               **news)
            return
        finally:
            await chunks.aclose()
        if req.include_usage and not usage.seen:  # the engine omitted it: computed (seed)
            held.append(sse_event(usage.chunk(placed.model, meter.tokens)))
        yield RelayMessage(
            data=b"".join(held) + DONE_EVENT,
            first_token=not committed,
            final=True,
            stats=at.stats(),
            **{"engines": at.route.engines, **at.news()},
        )

    async def _assemble(
        self, placed: PlacedRequest, at: Attempt, headers: dict[str, str], span: "Span | None"
    ) -> AsyncIterator[RelayMessage]:
        req = placed.request
        meter = at.meter
        asm = Assembler(req.route, return_token_ids=req.return_token_ids,
                        forced_tool_content=dialect_of(at.route.decode).forced_tool_content if forces_tool(req) else None)
        chunks = self._chunks(placed, at, headers, span)
        announced = False  # (the meter sees a batch's first token as the batch is read, before it comes here)
        try:
            async for batch in chunks:
                for chunk in batch:
                    asm.feed(chunk)
                if not announced and meter.first is not None:
                    announced = True
                    yield RelayMessage(first_token=True, engines=at.route.engines)  # prefill is over: frees the prefill permit
                news = at.news()
                if news:
                    yield RelayMessage(**news)
        except (EngineFailure, BadEngineResponse, DeadlinePassed) as exc:
            news = at.news()
            if news:  # what a resume moved and counted, before the failure goes to the next route
                yield RelayMessage(**news)
            raise exc from None
        finally:
            await chunks.aclose()
        engine_prompt = asm.prompt_token_ids
        result = asm.result(prompt_tokens=len(engine_prompt) if engine_prompt else req.prompt_tokens)
        result["model"] = placed.model
        body = json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode()
        yield RelayMessage(data=body, final=True, stats=at.stats(), **at.news())


_IDS_ONLY_KEYS = frozenset({"index", "delta", "finish_reason", "logprobs", "token_ids", "stop_reason"})


def ids_only(chunk: dict[str, Any]) -> bool:
    """A chat chunk that carries nothing but token IDs: vLLM sends one for a token its reasoning or
    tool parser held back (an empty ``delta``) only to a client that asked for IDs
    (chat_completion/serving.py: skipped unless ``return_token_ids``, before any usage is added;
    the next chunk carries the running usage); the router always asks."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for c in choices:
        if not isinstance(c, dict) or c.get("delta") != {} or c.get("finish_reason") is not None \
                or c.get("logprobs") is not None:
            return False
        if any(v is not None for k, v in c.items() if k not in _IDS_ONLY_KEYS):
            return False
    return True


def relay_of(engine_http: Literal["aiohttp", "httpx"], serving: ServingConfig, observability: ObservabilityConfig,
             *, coalesce_reads: bool = True) -> Relay:
    """The relay of a process that opens engine streams itself (an ingress replica with
    ``deployment.relay: ingress``, or an Assembler replica): its own pooled engine client."""
    return Relay.configured(engine_client(engine_http), serving, observability, coalesce_reads=coalesce_reads)
