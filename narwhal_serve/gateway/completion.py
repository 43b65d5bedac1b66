"""One completion request, arrival to last byte: validate, admit, relay, account, release.

Every path ends in exactly one terminal class (SPEC §5) and gives back everything it held:
the admission call runs in a task with a fresh context (Ray Serve cancels a cancelled request's
children), a placement that arrives after its client left is released, and the release itself goes
through the :class:`Reporter`, never through a child call of the request.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from narwhal_serve.admission.outcomes import Outcome
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.errors import ErrorInfo, InvalidApiKey, InvalidRequest, NarwhalError, TerminalExpiry
from narwhal_serve.gateway.backend import Backend
from narwhal_serve.gateway.body import BodyIncomplete, read_body
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.gateway.responses import error_response
from narwhal_serve.protocol.placement import PlacedRequest
from narwhal_serve.protocol.requests import ParsedRequest, Route, parse_request
from narwhal_serve.relay.messages import RelayMessage, RelayStats
from narwhal_serve.scheduler.messages import AdmitRequest, AdmitResult

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _seconds_header(request: Request, name: str) -> float | None:
    v = request.headers.get(name)
    if v is None:
        return None
    try:
        f = float(v)
    except ValueError:
        raise InvalidRequest(f"header {name} must be a number of seconds", param=name) from None
    if not f > 0:
        raise InvalidRequest(f"header {name} must be positive", param=name)
    return f


def _outcome_of(err: ErrorInfo) -> Outcome:
    if err.status == 504:
        return Outcome.EXPIRED
    if 400 <= err.status < 500:
        return Outcome.INVALID  # the engine rejected the request itself
    return Outcome.FAILED


def internal_error(message: str) -> ErrorInfo:
    return NarwhalError(message, code="internal_error").info()


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
    ) -> None:
        self.cfg = cfg
        self.echo_request_id = echo_request_id  # Ray Serve's proxy already echoes X-Request-Id
        self.backend = backend
        self.reporter = reporter
        self.clock = clock
        self.api_keys = frozenset(cfg.serving.api_keys)

    def _auth(self, request: Request) -> None:
        if not self.api_keys:
            return
        given = request.headers.get("authorization", "")
        key = given[7:] if given.startswith("Bearer ") else ""
        if key not in self.api_keys:
            raise InvalidApiKey("Incorrect or missing API key: send 'Authorization: Bearer <key>'.")

    def _deadline(self, request: Request, now: float) -> float:
        limits = [self.cfg.serving.request_timeout_s]
        for name in ("x-request-timeout", "x-stainless-timeout"):
            v = _seconds_header(request, name)
            if v is not None:
                limits.append(v)
        return now + min(limits)

    def _ttft_budget(self, request: Request) -> float:
        v = _seconds_header(request, "x-ttft-target")
        if v is None:
            return self.cfg.admission.ttft_budget_s
        return min(v, self.cfg.admission.max_ttft_budget_s)

    async def handle(self, request: Request, route: Route) -> Response:
        arrived = self.clock()
        rid = request.headers.get("x-request-id") or f"nw-{secrets.token_hex(12)}"
        echo = rid if self.echo_request_id else None
        self.reporter.offered()
        try:
            self._auth(request)
            raw = await read_body(request, self.cfg.serving.max_request_bytes)
            parsed = parse_request(route, raw, model=self.cfg.model)
            deadline = self._deadline(request, arrived)
            budget = self._ttft_budget(request)
        except BodyIncomplete:
            self.reporter.unsized()
            self.reporter.outcome(Outcome.CANCELLED, "body_incomplete")
            return Response(status_code=400)
        except NarwhalError as err:
            self.reporter.outcome(Outcome.INVALID, err.code)
            return error_response(err.info(), echo)
        task = asyncio.current_task()
        gone = asyncio.Event()
        watch = asyncio.get_running_loop().create_task(_watch_disconnect(request, task, gone))
        try:
            return await self._admitted(rid, echo, parsed, deadline, budget, arrived)
        except asyncio.CancelledError:
            if gone.is_set() and task is not None and task.uncancel() == 0:
                return Response(status_code=499)  # nobody is listening any more
            raise
        finally:
            watch.cancel()

    async def _admitted(
        self, rid: str, echo: str | None, parsed: ParsedRequest, deadline: float, budget: float, arrived: float
    ) -> Response:
        ticket = f"{rid}/{secrets.token_hex(4)}"
        admit_req = AdmitRequest(ticket, deadline, parsed.prompt_tokens, parsed.max_output_tokens, budget)
        try:
            result = await self._admit(admit_req)
        except Exception as exc:  # the scheduler could not be reached
            self.reporter.outcome(Outcome.FAILED, "internal_error")
            return error_response(internal_error(f"admission failed: {type(exc).__name__}"), echo)
        if result.error is not None:
            return error_response(result.error, echo)  # the scheduler counted it
        self.reporter.admission_wait(self.clock() - arrived)
        placed = PlacedRequest(rid, self.cfg.model, parsed, result.candidates, deadline)
        return await self._respond(placed, ticket, parsed, echo)

    async def _admit(self, req: AdmitRequest) -> AdmitResult:
        task = asyncio.get_running_loop().create_task(self.backend.admit(req), context=contextvars.Context())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._abandon(task, req.ticket_id)
            raise

    def _abandon(self, task: asyncio.Task[AdmitResult], ticket_id: str) -> None:
        """The client left while waiting for admission: withdraw the ticket (the scheduler frees a
        queue slot or a grant, now or when the admit call arrives) and count the cancellation,
        unless the scheduler had already refused — and counted — the request."""
        loop = asyncio.get_running_loop()
        loop.create_task(self.backend.cancel(ticket_id), context=contextvars.Context())

        def on_done(t: asyncio.Task[AdmitResult]) -> None:
            if not t.cancelled() and t.exception() is None:
                err = t.result().error
                if err is not None and err.code != "cancelled":
                    return
            self.reporter.outcome(Outcome.CANCELLED, "client_disconnected")

        task.add_done_callback(on_done)

    async def _respond(
        self, placed: PlacedRequest, ticket: str, parsed: ParsedRequest, rid: str | None
    ) -> Response:
        gen = self.backend.relay(placed)
        state = _Flow(self.reporter, ticket)
        rid_header = {"X-Request-Id": rid} if rid else {}
        try:
            first = await self._first_data(gen, placed.deadline, state)
        except asyncio.CancelledError:
            state.end(Outcome.CANCELLED, "client_disconnected")
            await _close(gen)
            raise
        except Exception as exc:
            state.end(Outcome.FAILED, "internal_error")
            await _close(gen)
            return error_response(internal_error(f"relay failed: {type(exc).__name__}"), rid)
        if first.error is not None and not first.data:
            state.end(_outcome_of(first.error), first.error.code)
            await _close(gen)
            return error_response(first.error, rid)
        if not parsed.stream:
            state.end(Outcome.COMPLETED, "", first.stats)
            await _close(gen)
            return Response(first.data, media_type="application/json", headers=rid_header)
        return StreamingResponse(
            _stream_rest(first, gen, state),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **rid_header},
        )

    async def _first_data(
        self, gen: AsyncIterator[RelayMessage], deadline: float, state: "_Flow"
    ) -> RelayMessage:
        """Messages up to the first that carries data or an error, within the deadline."""
        try:
            async with asyncio.timeout(max(0.0, deadline - self.clock())):
                async for msg in gen:
                    state.observe(msg)
                    if msg.data or msg.error is not None:
                        return msg
        except TimeoutError:
            return RelayMessage(error=deadline_expired(), final=True)
        return RelayMessage(error=internal_error("the assembler ended without an answer"), final=True)


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


class _Flow:
    """Tracks one admitted request's phase and makes sure it is released exactly once."""

    __slots__ = ("reporter", "ticket", "decoding", "ended")

    def __init__(self, reporter: Reporter, ticket: str) -> None:
        self.reporter = reporter
        self.ticket = ticket
        self.decoding = False
        self.ended = False

    def observe(self, msg: RelayMessage) -> None:
        if msg.first_token and not self.decoding and not msg.final:
            self.decoding = True
            self.reporter.decode_started(self.ticket)

    def end(self, outcome: Outcome, reason: str, stats: RelayStats | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.reporter.release(self.ticket, outcome, reason, stats)


async def _close(gen: AsyncIterator[RelayMessage]) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            pass


async def _stream_rest(first: RelayMessage, gen: AsyncIterator[RelayMessage], state: _Flow) -> AsyncIterator[bytes]:
    outcome, reason, stats = Outcome.CANCELLED, "client_disconnected", None
    try:
        msg = first
        while True:
            if msg.data:
                yield msg.data
            if msg.final:
                stats = msg.stats
                if msg.error is not None:
                    outcome, reason = Outcome.FAILED, msg.error.code
                else:
                    outcome, reason = Outcome.COMPLETED, ""
                return
            try:
                msg = await gen.__anext__()
            except StopAsyncIteration:
                err = internal_error("the assembler stream ended early")
                outcome, reason = Outcome.FAILED, "internal_error"
                yield b"data: " + _json_bytes(err.body()) + b"\n\ndata: [DONE]\n\n"
                return
            state.observe(msg)
    except Exception as exc:
        err = internal_error(f"relay failed: {type(exc).__name__}")
        outcome, reason = Outcome.FAILED, "internal_error"
        yield b"data: " + _json_bytes(err.body()) + b"\n\ndata: [DONE]\n\n"
    finally:
        state.end(outcome, reason, stats)
        await _close(gen)


def _json_bytes(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
