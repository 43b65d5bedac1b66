"""The simulator's KV-event publisher: vLLM's wire format and sockets (``narwhal_serve.kvevents.wire``).

A PUB socket sends each batch as ``(topic, seq, payload)``; a ROUTER socket replays buffered batches
from a requested sequence number, ending with the ``-1`` marker — as vLLM's ``ZmqEventPublisher``.
The engine publishes a ``BlockStored`` for the blocks a prefill added to its prefix cache (their
token IDs, parent hash and block size) and a ``BlockRemoved`` for the blocks it evicted.

Test hooks: :meth:`drop_next` loses batches on the live socket (they still get sequence numbers and
stay replayable), and a small ``buffer_steps`` makes a gap unreplayable.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from narwhal_serve.kvevents.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    encode_batch,
    seq_bytes,
    seq_of,
)
from narwhal_serve.ports import ipc_paths, remove_socket_files, socket_files


def _bind(sock: Any, endpoint: str, wait_s: float = 2.0) -> None:
    """Bind, waiting a little for a just-closed socket's address (ZMQ closes in its I/O thread)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                sock.close(linger=0)
                raise
            time.sleep(0.02)


class KVEventSink:
    """Where an engine's KV-cache events go: the builders of vLLM's three events, and ``publish``."""

    def publish(self, events: Sequence[Event]) -> None:
        raise NotImplementedError

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int) -> Event:
        return BlockStored(list(hashes), parent, list(token_ids), block_size, None, "GPU", None)

    def removed(self, hashes: Sequence[int]) -> Event:
        return BlockRemoved(list(hashes), "GPU")

    def cleared(self) -> Event:
        return AllBlocksCleared()

    def close(self) -> None:
        pass


class SimKVPublisher(KVEventSink):
    """vLLM's sockets: a PUB socket and, with ``replay_endpoint``, the ROUTER socket that replays."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "", buffer_steps: int = 10_000) -> None:
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind(self._pub, endpoint)
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._drop = 0
        self.published = 0
        self._running = True
        self._replay: Any = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            _bind(self._replay, replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True, name="sim-kv-replay")
            self._thread.start()
        # its socket files, removed at close (ZMQ leaves them)
        self._files = socket_files(ipc_paths((endpoint, replay_endpoint or "")))

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Sequence[Event]) -> None:
        if not events or not self._running:
            return
        payload = encode_batch(KVEventBatch(time.time(), list(events)))
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
            return
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:  # no room at the high-water mark: like vLLM, the batch stays replayable
            pass

    def drop_next(self, n: int) -> None:
        """Lose the next ``n`` batches on the live socket (a slow subscriber, a network blip)."""
        self._drop += n

    # ------------------------------------------------------------------ replay

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while self._running:
            try:
                if not poller.poll(100):
                    continue
                frames = self._replay.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = seq_of(start)
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= first]
            try:
                for s, p in batches:
                    self._replay.send_multipart((client, b"", self._topic, seq_bytes(s), p))
                self._replay.send_multipart((client, b"", b"", seq_bytes(END_SEQ), b""))
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        remove_socket_files(self._files)
