"""One engine's KV-event subscription: ZMQ SUB to its publisher, DEALER to its replay socket.

At start it asks the replay socket for everything buffered (from seq 0), so a router that starts
after the engine learns what the engine already holds.  Each live batch goes to the engine's
:class:`~narwhal_serve.kvevents.index.KVEventIndex`; a gap is filled from the replay socket, and when
the replay cannot fill it (the engine's buffer moved on, or there is no replay socket) the index is
resynced.  ZMQ reconnects by itself when the engine restarts; the index sees the new sequence start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.wire import END_SEQ, KVEventBatch, decode_batch, seq_bytes, seq_of

log = logging.getLogger("narwhal.kvevents")

REPLAY_TIMEOUT_S = 2.0  # the replay socket's silence that ends a replay
REPLAY_MAX_S = 30.0  # a whole replay
FILL_ROUNDS = 4  # replays asked for one gap, each from where the one before stopped (while they make progress)
YIELD_EVERY = 256  # replayed batches read or applied between two turns of the event loop
MAX_MESSAGE_BYTES = 64 << 20  # a frame larger than this is no KV-event batch (vLLM's are kilobytes to a few MB)
RESTART_S = 1.0


async def follow_forever(sub: "KVEventSubscriber") -> None:
    """Run ``sub``; one that fails (a bug, a bad endpoint) is restarted, never silently gone."""
    while True:
        try:
            await sub.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv events of %s: subscriber failed; restarting in %g s", sub.engine, RESTART_S)
            sub.state = "restarting"
            await asyncio.sleep(RESTART_S)


@dataclass
class KVEventSubscriber:
    engine: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    index: KVEventIndex
    state: str = "connecting"
    last_event_at: float | None = None
    errors: dict[str, int] = field(default_factory=lambda: {"malformed_frames": 0, "replay_timeouts": 0})
    _ctx: Any = None

    async def run(self) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # (a larger frame closes the connection: it reconnects)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint is not None:
                # from the batch after the last one applied (a restarted subscriber keeps its index:
                # replaying the whole buffer again was all duplicates); at the first start, everything
                start = 0 if self.index.last_seq is None else self.index.last_seq + 1
                await self._offer_all(self._replay(start))
            self.state = "subscribed"
            while True:
                frames = await sub.recv_multipart()
                got = self._decode(frames)
                if got is None:
                    continue
                self.last_event_at = time.time()
                await self._live(*got)
        finally:
            self.state = "stopped"
            sub.close(linger=0)

    async def _live(self, seq: int, batch: KVEventBatch) -> None:
        """One live batch.  Of a sequence begun before this subscriber heard it (a restarted
        publisher, or a start-up replay that brought nothing), the first batches come from the
        replay socket first; a gap before it is filled."""
        if seq > 0 and self.replay_endpoint is not None and (
                self.index.last_seq is None or self.index.classify(seq, batch) == "restart"):
            if self.index.last_seq is not None:
                self.index.restarted()
            await self._offer_all(self._replay(0), until=seq - 1)
        if self.index.offer(seq, batch) == "gap":
            await self._fill(seq, batch)

    def _decode(self, frames: list[bytes]) -> tuple[int, KVEventBatch] | None:
        if len(frames) != 3:
            self.errors["malformed_frames"] += 1
            return None
        if len(frames[1]) != 8:  # vLLM's sequence numbers are 8 bytes; one of 9 was a "gap" that wiped the index
            self.errors["malformed_frames"] += 1
            return None
        try:
            return seq_of(frames[1]), decode_batch(frames[2])
        except (msgspec.DecodeError, ValueError, RecursionError):  # (a frame nested deep enough: RecursionError)
            self.errors["malformed_frames"] += 1
            return None

    async def _fill(self, seq: int, batch: KVEventBatch) -> None:
        """A gap before ``seq``: replay what was missed, and ``batch``; else resync from ``batch``.
        A replay that comes back short (vLLM's replay socket drops what its send queue cannot hold,
        the end marker too, and a slow link cuts it at the time limits) is asked again from where
        it stopped, while each brings more: the index is cleared only when the engine's buffer has
        moved past what was missed."""
        expected = None
        for _ in range(FILL_ROUNDS):
            expected = (self.index.last_seq or 0) + 1
            before = self.index.last_seq
            first = await self._offer_all(self._replay(expected), until=seq - 1) \
                if self.replay_endpoint is not None else None
            if first is None or first > expected:
                break  # not replayable (any more)
            if self.index.last_seq == seq - 1:
                self.index.offer(seq, batch)
                return
            if self.index.last_seq == before:
                break  # no progress
        log.warning("kv events of %s: batches %s..%d missed and not replayable; index resynced",
                    self.engine, expected, seq - 1)
        self.index.resync(seq, batch)

    async def _offer_all(self, replayed: AsyncGenerator[tuple[int, KVEventBatch], None],
                         until: int | None = None) -> int | None:
        """Replayed batches offered in order as they arrive (up to sequence ``until``; each applied
        before the next is decoded: a whole replay held decoded at once is 10,000 batches of token
        IDs), a piece at a time: the loop's other work goes on during a long replay.  Up to a hole
        in them (a batch the replay lost): what follows it waits for the next replay.  The first
        batch's sequence number (None: nothing came)."""
        first = None
        i = 0
        async with contextlib.aclosing(replayed) as batches:
            async for s, b in batches:
                if first is None:
                    first = s
                if until is not None and s > until:
                    break
                if self.index.classify(s, b) == "gap":
                    break
                self.index.offer(s, b)
                i += 1
                if i % YIELD_EVERY == 0:
                    # frames already queued are read without the loop getting a turn: 10,000 of
                    # them stood the process still for seconds
                    await asyncio.sleep(0)
        return first

    async def _replay(self, start: int) -> AsyncGenerator[tuple[int, KVEventBatch], None]:
        """The replay socket's batches from ``start``, as they arrive (a generator: closing it
        closes the socket)."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.setsockopt(zmq.RCVHWM, 0)  # the whole replay queued here, not dropped on the way
        dealer.connect(self.replay_endpoint)
        loop = asyncio.get_running_loop()
        try:
            await dealer.send_multipart([b"", seq_bytes(start)])
            # each answer within REPLAY_TIMEOUT_S of the one before, the whole within REPLAY_MAX_S: a
            # single deadline for the whole stream cut vLLM's default buffer (10,000 batches) short
            # at a few thousand, and the first live batch after it then found a gap and cleared the
            # index.  (No timeout context spans a yield: its cancellation would land in the consumer.)
            end = loop.time() + REPLAY_MAX_S
            while True:
                left = min(REPLAY_TIMEOUT_S, end - loop.time())
                if left <= 0:
                    raise TimeoutError
                async with asyncio.timeout(left):
                    frames = await dealer.recv_multipart()
                if len(frames) == 4 and seq_of(frames[2]) == END_SEQ:
                    return
                got = self._decode(frames[1:])
                if got is not None:
                    yield got
        except TimeoutError:
            self.errors["replay_timeouts"] += 1
        finally:
            dealer.close(linger=0)

    def view(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "state": self.state,
                "last_event_at": self.last_event_at, **self.errors, **self.index.view()}
