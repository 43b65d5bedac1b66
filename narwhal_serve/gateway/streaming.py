"""The SSE response of an admitted streaming request: it owns the request's release.

Why a response class and not a generator handed to ``StreamingResponse``: when a client leaves
while the generator is suspended (at a ``yield`` or waiting for the next relay message), nothing
guarantees the generator's ``finally`` ever runs.  Here the release sits in the ``finally`` of the
ASGI call itself, which runs on every exit — the stream ended, a write failed, or Ray Serve
cancelled the request because the client went away.

Keep-alive: while the relay is silent (a stalled engine), an SSE comment is written every
``keepalive_s`` seconds.  Behind Ray Serve's HAProxy (direct-ingress mode) the replica learns of a
client that left only when a *write* to it fails, so a silent stream must keep writing
(ARCHITECTURE.md, "Direct ingress"); clients, the ``openai`` SDK included, ignore comment lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from narwhal_serve.admission.outcomes import Outcome
from narwhal_serve.errors import ErrorInfo, NarwhalError
from narwhal_serve.relay.messages import RelayMessage, RelayStats

KEEPALIVE = b": keep-alive\n\n"


def internal_error(message: str) -> ErrorInfo:
    return NarwhalError(message, code="internal_error").info()


def outcome_of(err: ErrorInfo) -> Outcome:
    """The terminal class of a request that ended with ``err`` after admission."""
    if err.status == 504:
        return Outcome.EXPIRED  # the deadline passed (before or after headers)
    if 400 <= err.status < 500:
        return Outcome.INVALID  # the engine rejected the request itself
    return Outcome.FAILED


def error_event(err: ErrorInfo) -> bytes:
    return b"data: " + json.dumps(err.body(), separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"


class Flow:
    """One admitted request's phase; reports its first token and its end exactly once."""

    __slots__ = ("on_first_token", "on_end", "decoding", "ended")

    def __init__(
        self,
        on_first_token: Callable[[RelayMessage], None],
        on_end: Callable[[Outcome, str, RelayStats | None, int], None],
    ) -> None:
        self.on_first_token = on_first_token
        self.on_end = on_end
        self.decoding = False
        self.ended = False

    def observe(self, msg: RelayMessage) -> None:
        if msg.first_token and not self.decoding and not msg.final:
            self.decoding = True
            self.on_first_token(msg)

    def end(self, outcome: Outcome, reason: str, stats: RelayStats | None = None, status: int = 200) -> None:
        """``status``: the HTTP status the client got (200 once stream headers are out)."""
        if not self.ended:
            self.ended = True
            self.on_end(outcome, reason, stats, status)


async def close_relay(gen: AsyncIterator[RelayMessage], pending: "asyncio.Future[RelayMessage] | None") -> None:
    """Cancel and await a pending ``__anext__`` first (its cancellation is what reaches the
    assembler), then close the generator."""
    if pending is not None and not pending.done():
        pending.cancel()
    if pending is not None:
        with contextlib.suppress(BaseException):
            await pending
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def close_detached(gen: AsyncIterator[RelayMessage], pending: "asyncio.Future[RelayMessage] | None" = None) -> None:
    """:func:`close_relay` in a task of its own context: Serve's cancellation of the request must
    not cancel the close (ARCHITECTURE.md, "cancellation trap")."""
    loop = asyncio.get_running_loop()
    loop.create_task(close_relay(gen, pending), context=contextvars.Context())


class RelayStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        first: RelayMessage,
        gen: AsyncIterator[RelayMessage],
        flow: Flow,
        keepalive_s: float,
        headers: dict[str, str],
    ) -> None:
        self.first = first
        self.gen = gen
        self.flow = flow
        self.keepalive_s = keepalive_s
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        end: tuple[Outcome, str, RelayStats | None] = (Outcome.CANCELLED, "client_disconnected", None)
        pending: asyncio.Future[RelayMessage] | None = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            msg = self.first
            while True:
                if msg.data:
                    await send({"type": "http.response.body", "body": msg.data, "more_body": True})
                if msg.final:
                    if msg.error is not None:
                        end = (outcome_of(msg.error), msg.error.code, msg.stats)
                    else:
                        end = (Outcome.COMPLETED, "", msg.stats)
                    break
                pending = asyncio.ensure_future(self.gen.__anext__())
                while True:
                    done, _ = await asyncio.wait({pending}, timeout=self.keepalive_s)
                    if done:
                        break
                    await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                fut, pending = pending, None
                try:
                    msg = fut.result()
                except StopAsyncIteration:
                    msg = _failure("the assembler stream ended early")
                except Exception as exc:
                    msg = _failure(f"relay failed: {type(exc).__name__}")
                self.flow.observe(msg)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away (ASGI 2.4 servers raise on a failed write): counted as cancelled
        finally:
            self.flow.end(*end)
            close_detached(self.gen, pending)


def _failure(message: str) -> RelayMessage:
    err = internal_error(message)
    return RelayMessage(data=error_event(err), error=err, final=True)
