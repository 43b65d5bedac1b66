"""The SSE response of an admitted streaming request: it owns the request's release.

Why a response class and not a generator handed to ``StreamingResponse``: when a client leaves
while the generator is suspended (at a ``yield`` or waiting for the next relay message), nothing
guarantees the generator's ``finally`` ever runs.  Here the release sits in the ``finally`` of the
ASGI call itself, which runs on every exit — the stream ended, a write failed, or Ray Serve
cancelled the request because the client went away.

Keep-alive: while the relay is silent (a stalled engine), an empty line is written every
``keepalive_s`` seconds.  Behind Ray Serve's HAProxy (direct-ingress mode) the replica learns of a
client that left only when a *write* to it fails, so a silent stream must keep writing
(docs/operations.md, "Run modes").  An empty line ends no event in an SSE parser (the ``openai``
SDKs'), and not a comment (``: keep-alive``): ``vllm bench serve`` strips each network read and
keeps a lone comment in its buffer, gluing every later event behind it (the rest of the answer lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.errors import ErrorInfo, NarwhalError, Unavailable
from narwhal_serve.assembly.usage import usage_chunk
from narwhal_serve.protocol.sse import error_events, sse_event
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.relay.messages import HealthEvent, RelayMessage

KEEPALIVE = b"\n"
DRAINED = "router_draining"


def drained_error() -> ErrorInfo:
    return Unavailable("the router is stopping: this stream was ended at the end of its drain grace period",
                       code=DRAINED, retry_after=1).info()


def internal_error(message: str) -> ErrorInfo:
    return NarwhalError(message, code="internal_error").info()


def outcome_of(err: ErrorInfo) -> Outcome:
    """The terminal class of a request that ended with ``err`` after admission."""
    if err.code == DRAINED:
        return Outcome.FAILED  # admitted, served in part, ended by the router's stop
    if err.status == 504:
        return Outcome.EXPIRED  # the deadline passed (before or after headers)
    if err.status == 503:
        return Outcome.REJECTED  # every engine tried pushed back (relay/attempt.py backpressure_refusal)
    if 400 <= err.status < 500:
        return Outcome.INVALID  # the engine rejected the request itself
    return Outcome.FAILED


class Flow:
    """One admitted request's phase; reports its first token and its end exactly once.  An end
    without stats reports the relay's final ones if they came (the client left during the last
    writes), else, after the first token (the stream cut: the client left, read too slowly, the
    router stopped; a non-streaming answer left or past its deadline), what the flow saw
    (RelayStats.cut): the route that was answering and the output tokens identified so far."""

    __slots__ = ("on_first_token", "on_end", "on_health", "on_progress", "on_resumes", "decoding", "ended",
                 "engines", "tokens", "final")

    def __init__(
        self,
        on_first_token: Callable[[RelayMessage], None],
        on_end: Callable[[Outcome, str, RelayStats | None, int], None],
        on_health: Callable[[tuple[HealthEvent, ...]], None] | None = None,
        on_progress: Callable[[int], None] | None = None,
        on_resumes: Callable[[tuple[tuple[str, str], ...]], None] | None = None,
    ) -> None:
        self.on_first_token = on_first_token  # also called again when a resume moves the answer
        self.on_end = on_end
        self.on_health = on_health
        self.on_progress = on_progress  # identified output tokens so far, as they arrive
        self.on_resumes = on_resumes  # (reason, outcome) of each mid-stream cut
        self.decoding = False
        self.ended = False
        self.engines: tuple[str, ...] = ()  # the route answering, as last announced
        self.tokens = 0  # output tokens identified so far
        self.final: RelayStats | None = None  # the relay's stats, once its final message came

    def observe(self, msg: RelayMessage) -> None:
        if msg.health and self.on_health is not None:
            self.on_health(msg.health)
        if msg.resumes and self.on_resumes is not None:
            self.on_resumes(msg.resumes)
        if msg.engines:
            self.engines = msg.engines
        if msg.tokens > self.tokens:
            self.tokens = msg.tokens
        if msg.final and msg.stats is not None:
            self.final = msg.stats
        if msg.first_token and not self.decoding and not msg.final:
            self.decoding = True
            self.on_first_token(msg)
        elif msg.moved and self.decoding and not self.ended:
            self.on_first_token(msg)  # the ledger moves the request to the engine it resumed on
        if msg.tokens and self.on_progress is not None and not self.ended:
            self.on_progress(msg.tokens)

    def end(self, outcome: Outcome, reason: str, stats: RelayStats | None = None, status: int = 200) -> None:
        """``status``: the HTTP status the client got (200 once stream headers are out)."""
        if not self.ended:
            self.ended = True
            if stats is None:
                stats = self.final
            if stats is None and self.decoding:
                stats = RelayStats.cut(self.engines, self.tokens)
            self.on_end(outcome, reason, stats, status)


async def close_relay(gen: AsyncIterator[RelayMessage], pending: "asyncio.Future[Any] | None") -> None:
    """Cancel and await what is reading the relay first (a pending ``__anext__`` or the reader
    task: its cancellation is what reaches the assembler or the engine stream), then close the
    generator."""
    if pending is not None and not pending.done():
        pending.cancel()
    if pending is not None:
        with contextlib.suppress(BaseException):
            await pending
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def close_detached(gen: AsyncIterator[RelayMessage], pending: "asyncio.Future[Any] | None" = None) -> None:
    """:func:`close_relay` in a task of its own context: Serve's cancellation of the request must
    not cancel the close (a cancelled request's own tasks are cancelled with it: the release is the reporter's, not the request's)."""
    loop = asyncio.get_running_loop()
    loop.create_task(close_relay(gen, pending), context=contextvars.Context())


class _SlowReader(Exception):
    """The client reads too slowly: one write stayed blocked past the write timeout."""


class RelayStreamResponse(Response):
    """Writes the relay's messages as they come, and bounds what a slow client can cost.

    A reader task pulls relay messages ahead of the client into a buffer; past ``buffer_bytes``
    of unsent data it stops pulling until the writer has sent half of it (the client's pace, not
    the engine's, sets how much is held here).  Each write must complete within
    ``write_timeout_s``: a client that stops reading is cut (one last error event is tried,
    briefly), the relay is closed (the engine request is aborted) and the request ends
    ``failed``/``slow_reader``.  So a slow reader costs at most the buffer plus what the assembler
    sends during one write timeout — never an unbounded buffer.  (Behind Serve's proxy actor the
    actor itself buffers and the ingress cannot see the client's pace; direct ingress is the run
    mode.)
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        first: RelayMessage,
        gen: AsyncIterator[RelayMessage],
        flow: Flow,
        keepalive_s: float,
        headers: dict[str, str],
        *,
        buffer_bytes: int = 1 << 20,
        write_timeout_s: float = 30.0,
    ) -> None:
        self.first = first
        self.gen = gen
        self.flow = flow
        self.keepalive_s = keepalive_s
        self.buffer_bytes = buffer_bytes
        self.write_timeout_s = write_timeout_s
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self._buf: deque[RelayMessage] = deque([first])
        self._size = len(first.data)
        self._more = asyncio.Event()  # the reader added a message
        self._cut = False
        self.on_done: Callable[[RelayStreamResponse], None] | None = None  # the handler's registry
        self._room = asyncio.Event()  # the writer brought the buffer down to half its cap
        # (RelayMessage.usage_meta; none once the engine's usage chunk went out, in this one too)
        self._usage_meta = None if first.usage_sent else first.usage_meta

    async def _read(self) -> None:
        """Pull relay messages ahead of the client, up to the final one, pausing at the cap (one
        task for the whole stream: cancelling it cancels the relay read in flight)."""
        try:
            async for msg in self.gen:
                if self._take(msg):
                    return
                if self._size > self.buffer_bytes:
                    self._room.clear()
                    await self._room.wait()
            self._take(self._ending(internal_error("the assembler stream ended early")))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._take(self._ending(internal_error(f"relay failed: {type(exc).__name__}")))

    def _ending(self, err: ErrorInfo) -> RelayMessage:
        """The stream's last message when the router ends it: a usage chunk if the client asked
        for usage and the engine's has not gone out (the output tokens identified so far: on
        every failure path, one usage chunk, never two), the error event and ``[DONE]``."""
        usage = b""
        if self._usage_meta is not None:
            meta, prompt_tokens = self._usage_meta
            usage = sse_event(usage_chunk(meta, prompt_tokens, self.flow.tokens))
        return RelayMessage(data=usage + error_events(err), error=err, final=True)

    def cut(self, err: ErrorInfo) -> None:
        """End the stream with ``err`` (:meth:`_ending`) after what is already buffered: the
        router is stopping.  The relay is closed as the stream ends."""
        if not self._cut:
            self._cut = True
            self._buf.append(self._ending(err))
            self._more.set()

    def _take(self, msg: RelayMessage) -> bool:
        if self._cut:
            return True  # the stream is being ended: nothing more goes into it
        if msg.usage_meta is not None:
            self._usage_meta = msg.usage_meta
        if msg.usage_sent:
            self._usage_meta = None  # (the engine's went out: no second one)
        self.flow.observe(msg)
        self._buf.append(msg)
        self._size += len(msg.data)
        self._more.set()
        return msg.final

    async def _write(self, send: Send, body: bytes, more_body: bool = True) -> None:
        """One write, within ``write_timeout_s`` (a failed write, the client gone, raises)."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await send({"type": "http.response.body", "body": body, "more_body": more_body})
        except TimeoutError:
            raise _SlowReader() from None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        end: tuple[Outcome, str, RelayStats | None] = (Outcome.CANCELLED, "client_disconnected", None)
        reader: asyncio.Task[None] | None = None
        delivered = False  # the final message (its [DONE]) was written
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if not self.first.final:
                reader = asyncio.ensure_future(self._read())
            while True:
                while not self._buf:
                    if reader is not None and reader.done():  # it stopped before the final message
                        self._buf.append(self._ending(internal_error("the relay reader stopped")))
                        break
                    self._more.clear()
                    try:
                        async with asyncio.timeout(self.keepalive_s):
                            await self._more.wait()
                    except TimeoutError:
                        await self._write(send, KEEPALIVE)
                msg = self._buf.popleft()
                self._size -= len(msg.data)
                if self._size <= self.buffer_bytes // 2:
                    self._room.set()
                if msg.data:
                    await self._write(send, msg.data)
                if msg.final:
                    delivered = True
                    if msg.error is not None:
                        end = (outcome_of(msg.error), msg.error.reason or msg.error.code, msg.stats)
                    else:
                        end = (Outcome.COMPLETED, "", msg.stats)
                    break
            await self._write(send, b"", more_body=False)
        except _SlowReader:
            if delivered:  # only the closing empty write was slow: the answer was handed over whole
                return
            end = (Outcome.FAILED, "slow_reader", None)
            err = NarwhalError("the client did not read the stream fast enough; it was cut", code="slow_reader")
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(1.0):  # best effort: the client is not reading
                    await send({"type": "http.response.body", "body": error_events(err.info()), "more_body": False})
        except OSError:
            pass  # the client went away (ASGI 2.4 servers raise on a failed write): counted as cancelled
        finally:
            self.flow.end(*end)
            close_detached(self.gen, reader)
            if self.on_done is not None:
                self.on_done(self)
