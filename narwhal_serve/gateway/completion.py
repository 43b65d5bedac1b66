"""One completion request, arrival to last byte: validate, admit, relay, account, release.

Every path ends in exactly one terminal class (docs/contract.md, "Admission") and gives back everything it held:
the admission call runs in a task with a fresh context (Ray Serve cancels a cancelled request's
children), a placement that arrives after its client left is released, and the release itself goes
through the :class:`Reporter`, never through a child call of the request.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from narwhal_serve.admission.core import Ask, FleetView
from narwhal_serve.admission.retry import retry_count
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.errors import BodyTimeout, ErrorInfo, InvalidRequest, NarwhalError, TerminalExpiry, bad_request_id
from narwhal_serve.gateway.admit import Refused, admit, undelivered
from narwhal_serve.gateway.backend import Backend
from narwhal_serve.gateway.body import BodyIncomplete, header, read_body, received_at, seconds_header
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.gateway.responses import BODY_INCOMPLETE, closing_after, error_response
from narwhal_serve.gateway.streaming import (
    Flow,
    RelayStreamResponse,
    close_detached,
    drained_error,
    internal_error,
    outcome_of,
)
from narwhal_serve.observability import Observability, RequestTrail
from narwhal_serve.placement.prefix import request_prefix
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.protocol.requests import ParsedRequest, Route, parse_request, truncated_to
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.messages import RelayMessage
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult
from narwhal_serve.gateway.tenancy import Tenancy
from narwhal_serve.tokenization.sizer import PromptSizer, Sized

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # printable ASCII, no spaces

log = logging.getLogger(__name__)


def _limited(err: ErrorInfo, limits: dict[str, str] | None) -> ErrorInfo:
    """An answer to a budgeted tenant after admission carries its rate-limit headers (the request
    was charged to the budget), as every answer to it does."""
    return replace(err, extra_headers=(*err.extra_headers, *limits.items())) if limits else err


def deadline_expired() -> ErrorInfo:
    return TerminalExpiry(
        "terminal expiry: the request deadline passed before response headers", code="deadline_expired"
    ).info()


class CompletionHandler:
    def __init__(
        self,
        cfg: NarwhalConfig,
        backend: Backend,
        reporter: Reporter,
        clock: Callable[[], float] = time.time,
        *,
        echo_request_id: bool = True,
        mono: Callable[[], float] = time.monotonic,
        sizer: PromptSizer | None = None,
        node: str | None = None,
        stamp_key: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.stamp_key = stamp_key  # HAProxy stamps each request's receipt with it (runenv.RECEIVED_HEADER)
        self.node = node  # the Ray node this ingress replica runs on (placement prefers engines there)
        self.sizer = sizer if sizer is not None else PromptSizer(None)
        self.mono = mono
        self.echo_request_id = echo_request_id  # Ray Serve's proxy already echoes X-Request-Id
        self.backend = backend
        self.reporter = reporter
        self.clock = clock
        self.tenancy = Tenancy(cfg, mono)
        self.obs = Observability(cfg.observability, clock)
        self.streams: set[RelayStreamResponse] = set()  # open SSE answers, ended together when draining ends
        self._before_headers: set[asyncio.Task[Any]] = set()  # admitted answers not begun yet (drain: answered 503)
        self._drained: set[asyncio.Task[Any]] = set()  # of those, the ones the end of a drain cancelled
        self._drain_end: float | None = None  # on this replica's clock
        self._drain_raw: float | None = None  # the same, on the scheduler's
        self._drain_timer: asyncio.TimerHandle | None = None
        self._tripped: dict[str, float] = {}  # engines whose breaker opened, and when, as last heard

    def on_view(self, view: FleetView) -> None:
        """A fresh view from the scheduler: the answers streaming from an engine whose circuit
        breaker opened since the last view are resumed elsewhere where that is exact
        (docs/contract.md, "Mid-stream resume"); when the router drains, the streams still open at
        the end of its grace period end (each with an error event and ``[DONE]``, never cut)."""
        if view.tripped or self._tripped:
            relay = self.backend.local_relay
            for name, at in view.tripped:
                if relay is not None and self._tripped.get(name) != at:
                    relay.cut_engine(name, "its circuit breaker opened")
            self._tripped = dict(view.tripped)
        raw = view.streams_end_at
        if raw is None or raw == self._drain_raw:
            return  # (the same drain: its end on the scheduler's clock)
        self._drain_raw = raw
        end = self._drain_end = raw + view.shift  # (on this replica's clock)
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self._drain_timer = asyncio.get_running_loop().call_later(max(0.0, end - self.clock()), self.end_streams)

    def end_streams(self) -> None:
        """The drain's grace is over: open streams end (an error event and ``[DONE]``), and the
        answers not begun yet (a non-streaming answer being assembled, a stream before its first
        token) are answered the drain's 503 instead of being cut by the shutdown."""
        err = drained_error()
        for s in list(self.streams):
            s.cut(err)
        for task in list(self._before_headers):
            if task not in self._drained:
                self._drained.add(task)
                task.cancel()

    def _deadline(self, request: Request, now: float) -> float:
        limits = [self.cfg.serving.request_timeout_s]
        for name in ("x-request-timeout", "x-stainless-timeout"):
            # openai-node sends its timeout in whole seconds, rounded down: 0 is "under a second"
            v = seconds_header(request, name, zero_is_none=name == "x-stainless-timeout")
            if v is not None:
                limits.append(v)
        return now + min(limits)

    def _ttft_budget(self, request: Request) -> float:
        v = seconds_header(request, "x-ttft-target")
        if v is None:
            return self.cfg.admission.ttft_budget_s
        return min(v, self.cfg.admission.max_ttft_budget_s)

    def _tpot_budget(self, request: Request) -> float | None:
        v = seconds_header(request, "x-tpot-target")
        if v is None:
            return self.cfg.admission.tpot_budget_s
        return min(v, self.cfg.admission.max_tpot_budget_s)

    def _ask(self, sized: Sized, ttft_budget: float, tpot_budget: float | None, retries: int | None,
             tenant: str = "", raw: bytes = b"", priority: tuple[int, float | None] = (0, None)) -> Ask:
        """What admission judges: sizes, targets, the prompt's prefix blocks, and whether the client
        retries (``X-Stainless-Retry-Count``: admission/retry.py).  Blocks are of the prompt's token
        IDs where the router has them (its tokenizer, or a token-ID prompt), else of characters."""
        pl = self.cfg.placement
        parsed = sized.parsed
        prefix: tuple[int, ...] = ()
        block_tokens = 0.0
        if pl.prefix_aware and self.cfg.admission.mode == "predictive":
            prefix, block_tokens = request_prefix(parsed.route, parsed.body, sized.ids,
                                                  pl.prefix_block_chars, pl.prefix_block_tokens, pl.prefix_max_blocks)
        return Ask(parsed.prompt_tokens, ttft_budget, tpot_budget, parsed.route, parsed.max_output_tokens,
                   prefix, block_tokens, retry=bool(retries), reserves=retries is not None, tenant=tenant,
                   fingerprint=self.tenancy.fingerprint(tenant, raw, retries),
                   rank=priority[0], admit_within_s=priority[1], node=self.node,
                   min_output_tokens=parsed.min_output_tokens, exact=sized.exact, output_param=parsed.max_output_param,
                   truncate_to=truncated_to(parsed.body) or 0)

    async def handle(self, request: Request, route: Route) -> Response:
        arrived = self.clock()
        if self.stamp_key is not None:  # it reached the router at HAProxy (its wait in the queues before counts)
            arrived = received_at(request, arrived, self.cfg.serving.request_timeout_s, self.stamp_key)
        self.reporter.start_once()
        given = request.headers.get("x-request-id")  # (a second value is refused below, with the id kept)
        rid = given if given and _REQUEST_ID.fullmatch(given) else f"nw-{secrets.token_hex(12)}"
        echo = rid if self.echo_request_id else None
        self.reporter.offered()
        trail = self.obs.trail(rid, request.scope["path"], arrived, request.headers)  # (not request.url: it builds the whole URL)
        tenant: str | None = None
        try:
            if given is not None and given != rid:  # it goes to every engine leg as a header: keep it plain
                raise bad_request_id()
            header(request, "x-request-id")  # (sent twice with different values: 400)
            tenant = self.tenancy.identify(request)
            trail.tenant = self.tenancy.label(tenant)
            priority = self.tenancy.priority(request, tenant)
            trail.priority = self.tenancy.class_name(priority[0])
            try:
                raw = await read_body(request, self.cfg.serving.max_request_bytes, self.cfg.serving.body_timeout_s)
            except asyncio.CancelledError:  # Serve cancels the handler when the client leaves mid-body
                self._left_unsized(trail, "body_incomplete", 499)
                raise
            try:
                sized = await self.sizer.size(parse_request(route, raw, model=self.cfg.model,
                                                            max_logprobs=self.cfg.serving.max_logprobs))
            except asyncio.CancelledError:  # the client left while a long prompt was tokenized
                self._left_unsized(trail, "client_disconnected", 499)
                raise
            parsed = sized.parsed
            deadline = self._deadline(request, arrived)
            budget = self._ttft_budget(request)
            ask = self._ask(sized, budget, self._tpot_budget(request), retry_count(header(request, "x-stainless-retry-count")),
                            tenant, raw, priority)
        except BodyIncomplete as short:
            self._left_unsized(trail, "body_incomplete", 499 if short.left else 400)
            # the client ended the body early (it most likely left; if it still reads, it gets why)
            err = InvalidRequest(BODY_INCOMPLETE, code="body_incomplete")
            return error_response(err.info(), echo)
        except NarwhalError as err:
            resp = self._refused(trail, Outcome.INVALID, self._limited_for(err.info(), tenant), echo)
            if isinstance(err, BodyTimeout):
                self.reporter.unsized()  # the body never ended: it was never sized
            return closing_after(err, resp)
        except Exception as exc:  # a fault in the router's own code: answered, counted and logged as one
            log.exception("request %s failed before admission", rid)
            return self._refused(trail, Outcome.FAILED,
                                 self._limited_for(internal_error(f"internal error: {type(exc).__name__}"), tenant), echo)
        trail.parsed(parsed.stream, parsed.prompt_tokens, lambda: _prompt_text(parsed), sized.method)
        task = asyncio.current_task()
        gone = asyncio.Event()
        watch = asyncio.get_running_loop().create_task(_watch_disconnect(request, task, gone))
        try:
            return await self._admitted(trail, echo, parsed, deadline, ask)
        except asyncio.CancelledError:
            trail.end(Outcome.CANCELLED, "client_disconnected", 499)  # no-op when the flow has ended it
            if gone.is_set() and task is not None and task.uncancel() == 0:
                return Response(status_code=499)  # nobody is listening any more
            raise
        finally:
            watch.cancel()

    def _left_unsized(self, trail: RequestTrail, reason: str, status: int) -> None:
        """The client left before its request was sized: counted offered, unsized and cancelled, logged."""
        self.reporter.unsized()
        self.reporter.outcome(Outcome.CANCELLED, reason, trail.tenant, trail.priority)
        trail.end(Outcome.CANCELLED, reason, status)

    def _refused(
        self, trail: RequestTrail, outcome: Outcome, err: ErrorInfo, echo: str | None, *, counted: bool = False
    ) -> Response:
        """A refusal before response headers: counted (unless the scheduler did), logged, answered."""
        if not counted:
            self.reporter.outcome(outcome, err.code, trail.tenant, trail.priority)
        trail.end(outcome, err.code, err.status)
        return error_response(err, echo)

    async def _admitted(
        self, trail: RequestTrail, echo: str | None, parsed: ParsedRequest, deadline: float, ask: Ask
    ) -> Response:
        rid = trail.request_id
        ticket = f"{rid}/{secrets.token_hex(4)}"
        now = self.clock()
        ask = replace(ask, waited_s=max(0.0, now - trail.arrived))  # (its TTFT is counted from its arrival)
        called = False  # the scheduler's admit call was made (_abandon counts a client leaving during it)

        async def call(req: AdmitRequest) -> AdmitResult:
            nonlocal called
            called = True
            return await self._admit(req)

        try:
            got = await admit(self.reporter, ticket, ask, deadline, now, self.mono(), call,
                              slots_counted=self.tenancy.slots_counted(ask.tenant))
        except asyncio.CancelledError:  # the client left before the call (a tenant's flush of what ended)
            if not called:
                self.reporter.outcome(Outcome.CANCELLED, "client_disconnected", trail.tenant, trail.priority)
            raise
        except Exception:  # a fault in the router's own code: what the lease may have placed is freed
            self.reporter.ended(ticket, Outcome.FAILED, "internal_error", None, trail.tenant, trail.priority)
            trail.end(Outcome.FAILED, "internal_error", 500)
            raise
        if isinstance(got, Refused):
            return self._refused(trail, got.outcome, self._with_limits(got.error, ask.tenant), echo, counted=got.counted)
        try:
            wait = self.clock() - trail.arrived
            self.reporter.admission_wait(wait)
            # its predicted TTFT counted as its TTFT is, from its receipt: the wait so far and the projection
            predicted = None if got.predicted_s is None else wait + got.predicted_s
            trail.admitted(got.by, wait, predicted, got.routes[0].engines if got.routes else ())
            traceparent, tracestate = trail.trace_context()
            placed = PlacedRequest(rid, self.cfg.model, parsed, got.routes, deadline, traceparent,
                                   self._first_token_s(ask.ttft_budget_s, got.predicted_s), got.epoch, ask.rank,
                                   tracestate=tracestate, received=trail.arrived)
            return await self._respond(placed, ticket, parsed, echo, trail, predicted,
                                       self.tenancy.limits(ask.tenant, got.remaining))
        except Exception:  # a fault in the router's own code (gateway/app.py answers it 500)
            if not trail.ended:  # (else its flow ended, counted and released it)
                self.reporter.ended(ticket, Outcome.FAILED, "internal_error", None, trail.tenant, trail.priority)
                trail.end(Outcome.FAILED, "internal_error", 500)
            raise

    def _limited_for(self, err: ErrorInfo, tenant: str | None) -> ErrorInfo:
        """``err`` with a budgeted tenant's rate-limit headers (none: no tenant identified yet)."""
        return err if tenant is None else self._with_limits(err, tenant)

    def _with_limits(self, err: ErrorInfo, tenant: str) -> ErrorInfo:
        """A refusal to a budgeted tenant carries its rate-limit headers, as every answer to it does
        (a budget refusal has them already; found by a hostile probe on an admission refusal)."""
        if any(k.startswith("x-ratelimit-") for k, _ in err.extra_headers):
            return err
        shares = self.reporter.lease.shares if self.reporter.lease is not None else None
        limits = self.tenancy.limits(tenant, shares.remaining(tenant, self.clock()) if shares is not None else None)
        return replace(err, extra_headers=(*err.extra_headers, *limits.items())) if limits else err

    def _first_token_s(self, budget: float, predicted: float | None) -> float:
        """Before headers, how long an attempt may wait for its first token while another route is
        left: configured, else 3× the larger of the TTFT budget and the prediction (at least 2 s)."""
        return self.cfg.serving.first_token_limit(max(budget, predicted or 0.0))

    async def _admit(self, req: AdmitRequest) -> AdmitResult:
        task = asyncio.get_running_loop().create_task(self.backend.admit(req), context=contextvars.Context())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._abandon(task, req)
            raise

    def _abandon(self, task: asyncio.Task[AdmitResult], req: AdmitRequest) -> None:
        """The client left while waiting for admission: withdraw the ticket (the scheduler frees a
        queue slot or a grant, now or when the admit call arrives) and count the cancellation,
        unless the scheduler had already refused — and counted — the request."""
        loop = asyncio.get_running_loop()
        loop.create_task(self.backend.cancel(req.ticket_id), context=contextvars.Context())
        tenant, klass = self.tenancy.label(req.tenant), self.tenancy.class_name(req.rank)

        def on_done(t: asyncio.Task[AdmitResult]) -> None:
            if not t.cancelled() and t.exception() is None:
                err = t.result().error
                if err is not None and err.code != "cancelled":
                    return
            elif not t.cancelled() and self.reporter.lease is not None:  # the call never reached the scheduler
                undelivered(self.reporter.lease, req)
            self.reporter.outcome(Outcome.CANCELLED, "client_disconnected", tenant, klass)

        task.add_done_callback(on_done)

    async def _respond(
        self, placed: PlacedRequest, ticket: str, parsed: ParsedRequest, rid: str | None, trail: RequestTrail,
        predicted_ttft_s: float | None = None, limits: dict[str, str] | None = None,
    ) -> Response:
        gen = self.backend.relay(placed)
        flow = Flow(lambda msg: self._first_token(ticket, msg), lambda o, r, st, code: self._end(ticket, trail, o, r, st, code),
                    self.reporter.engine_health, lambda n: self.reporter.progress(ticket, n), self.reporter.resumes)
        rid_header = {"X-Request-Id": rid} if rid else {}
        # the TTFT its admission predicted (predictive mode): clients and benchmarks can check it
        ok_headers = {} if predicted_ttft_s is None else {"X-Narwhal-Predicted-TTFT": f"{predicted_ttft_s:.4f}"}
        if limits:
            ok_headers.update(limits)
        task = asyncio.current_task()
        assert task is not None
        self._before_headers.add(task)
        try:
            first = await self._first_data(gen, placed.deadline, flow)
        except asyncio.CancelledError:
            if task in self._drained and task.uncancel() == 0:  # (end_streams: not the client leaving)
                first = RelayMessage(error=drained_error(), final=True)
            else:
                flow.end(Outcome.CANCELLED, "client_disconnected", status=499)
                close_detached(gen)
                raise
        except Exception as exc:
            err = internal_error(f"relay failed: {type(exc).__name__}")
            flow.end(Outcome.FAILED, "internal_error", status=err.status)
            close_detached(gen)
            return error_response(_limited(err, limits), rid)
        finally:
            self._before_headers.discard(task)
            self._drained.discard(task)
        if first.error is not None and not first.data:
            flow.end(outcome_of(first.error), first.error.reason or first.error.code, first.stats, first.error.status)
            close_detached(gen)
            return error_response(_limited(first.error, limits), rid)
        if not parsed.stream:
            flow.end(Outcome.COMPLETED, "", first.stats)
            close_detached(gen)
            return Response(first.data, media_type="application/json", headers={**rid_header, **ok_headers})
        sv = self.cfg.serving
        resp = RelayStreamResponse(first, gen, flow, sv.stream_keepalive_s, {**SSE_HEADERS, **rid_header, **ok_headers},
                                   buffer_bytes=sv.stream_buffer_bytes, write_timeout_s=sv.slow_reader_timeout_s)
        self.streams.add(resp)
        resp.on_done = self.streams.discard
        if self._drain_end is not None and self.clock() >= self._drain_end:
            resp.cut(drained_error())  # admitted just before the drain began, started after its grace
        return resp

    def _first_token(self, ticket: str, msg: RelayMessage) -> None:
        self.reporter.first_token(ticket, msg.engines)

    def _end(
        self, ticket: str, trail: RequestTrail, outcome: Outcome, reason: str, stats: RelayStats | None, status: int
    ) -> None:
        self.reporter.ended(ticket, outcome, reason, stats, trail.tenant, trail.priority)
        trail.end(outcome, reason, status, stats)

    async def _first_data(
        self, gen: AsyncIterator[RelayMessage], deadline: float, flow: Flow
    ) -> RelayMessage:
        """Messages up to the first that carries data or an error, within the deadline."""
        try:
            async with asyncio.timeout(max(0.0, deadline - self.clock())):
                async for msg in gen:
                    flow.observe(msg)
                    if msg.data or msg.error is not None:
                        return msg
        except TimeoutError:
            return RelayMessage(error=deadline_expired(), final=True)
        return RelayMessage(error=internal_error("the assembler ended without an answer"), final=True)


def _prompt_text(parsed: ParsedRequest) -> str | None:
    """The prompt as sent (messages or prompt, JSON): only ever logged when the operator asks."""
    key = "messages" if parsed.route == "chat" else "prompt"
    v = parsed.body.get(key)
    return None if v is None else json.dumps(v, ensure_ascii=False)


async def _watch_disconnect(request: Request, task: "asyncio.Task[object] | None", gone: asyncio.Event) -> None:
    """Cancel ``task`` when the client disconnects before response headers (the body is already
    read, so the next ASGI message can only be the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            gone.set()
            if task is not None:
                task.cancel()
            return
