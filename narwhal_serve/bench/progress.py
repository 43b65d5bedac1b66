"""A one-line progress report on stderr while a run is going (``\\r``-refreshed on a terminal,
a plain line every few seconds otherwise)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from narwhal_serve.bench.stats import RequestResult


class Progress:
    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.sent = 0
        self.done = 0
        self.ok = 0
        self.refused = 0
        self.failed = 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def record(self, r: RequestResult) -> None:
        self.done += 1
        if r.ok:
            self.ok += 1
        elif r.refused:
            self.refused += 1
        else:
            self.failed += 1

    def line(self) -> str:
        total = f"/{self.total}" if self.total else ""
        return (f"[{self.label}] {time.perf_counter() - self.t0:5.1f}s sent {self.sent}{total} "
                f"done {self.done} ok {self.ok} refused {self.refused} failed {self.failed}")

    async def _loop(self) -> None:
        tty = self.stream.isatty()
        every = 0.5 if tty else 5.0
        while True:
            await asyncio.sleep(every)
            self.stream.write(("\r\x1b[2K" + self.line()) if tty else self.line() + "\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        self.t0 = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        end = "\r\x1b[2K" if self.stream.isatty() else ""
        self.stream.write(end + self.line() + "\n")
        self.stream.flush()
