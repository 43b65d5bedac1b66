"""What each part of the router that would run for real costs in a replay, as CPU time of this
process (``time.thread_time``): the scheduler's report handling (lease grants and their views
included), its admit calls, its scrapes (parsing and applying an engine's ``/metrics``, not the
simulator rendering it), its periodic work (reaping, drift, probes), the KV-event index (or, with
shards, applying their changes; each shard's own index is ``kvshard.*``), and each ingress lease's
decisions, grant applications and report cuts; and, as a report and its grant (or a shard's
changes) cross a Ray hop, their serialization each side.  Wrappers on the live objects,
so an un-costed replay pays nothing."""

from __future__ import annotations

import gc
import pickle
import sys
import time
import types
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Cost:
    calls: int = 0
    ns: int = 0
    samples: list[int] = field(default_factory=list)  # per call, for the parts whose percentiles matter


@dataclass
class Costs:
    parts: dict[str, Cost] = field(default_factory=dict)
    sampled: frozenset[str] = frozenset({"ingress.decide", "scheduler.admit"})

    def add(self, part: str, ns: int) -> None:
        c = self.parts.setdefault(part, Cost())
        c.calls += 1
        c.ns += ns
        if part in self.sampled:
            c.samples.append(ns)

    def timed(self, part: str, fn: Callable[..., T]) -> Callable[..., T]:
        def wrapper(*args: Any, **kwargs: Any) -> T:
            t = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.thread_time_ns() - t)

        return wrapper

    def timed_async(self, part: str, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        """The CPU of each step of the coroutine (its waits not counted), as one call."""
        async def wrapper(*args: Any, **kwargs: Any) -> T:
            steps = _Steps(fn(*args, **kwargs))
            try:
                out: T = await steps
                return out
            finally:
                self.add(part, steps.ns)

        return wrapper

    def carried(self, obj: T, sender: str, receiver: str) -> T:
        """``obj`` across a Ray hop: pickled by ``sender`` and read by ``receiver`` (``<side>.hop``)."""
        t = time.thread_time_ns()
        data = pickle.dumps(obj, protocol=5)
        self.add(f"{sender}.hop", time.thread_time_ns() - t)
        t = time.thread_time_ns()
        out: T = pickle.loads(data)
        self.add(f"{receiver}.hop", time.thread_time_ns() - t)
        return out

    def hop(self, send: Callable[[Any], Awaitable[T]]) -> Callable[[Any], Awaitable[T]]:
        """``send`` across a Ray hop: the message pickled by the ingress and read by the scheduler,
        the answer pickled by the scheduler and read by the ingress (``*.hop``: what Ray's
        serialization of a report and its grant costs each side)."""
        async def across(message: Any) -> T:
            answer = await send(self.carried(message, "ingress", "scheduler"))
            return self.carried(answer, "scheduler", "ingress")

        return across

    def report(self, requests: int, virtual_s: float) -> list[dict[str, Any]]:
        """One row per part: calls, CPU, per call (p50 and p99 where sampled), per request, and its
        share of one core at the replayed rate (CPU seconds per virtual second)."""
        rows = []
        for name, c in sorted(self.parts.items()):
            cpu_s = c.ns / 1e9
            xs = sorted(c.samples)
            rows.append({"part": name, "calls": c.calls, "cpu_s": round(cpu_s, 3),
                         "us_per_call": round(c.ns / 1e3 / c.calls, 1) if c.calls else None,
                         "p50_us": round(xs[len(xs) // 2] / 1e3, 1) if xs else None,
                         "p99_us": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))] / 1e3, 1) if xs else None,
                         "us_per_request": round(c.ns / 1e3 / requests, 1) if requests else None,
                         "core_share": round(cpu_s / virtual_s, 4) if virtual_s > 0 else None})
        return rows


class _Steps:
    def __init__(self, coro: Awaitable[Any]) -> None:
        self.coro = coro
        self.ns = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self.coro.__await__()
        send: Any = None
        throw: BaseException | None = None
        while True:
            t = time.thread_time_ns()
            try:
                out = it.send(send) if throw is None else it.throw(throw)
            except StopIteration as stop:
                self.ns += time.thread_time_ns() - t
                return stop.value
            except BaseException:
                self.ns += time.thread_time_ns() - t
                raise
            self.ns += time.thread_time_ns() - t
            try:
                send, throw = (yield out), None
            except BaseException as exc:  # (a cancellation goes into the coroutine)
                send, throw = None, exc


_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
              types.CodeType, types.FrameType)


def deep_size(*roots: object) -> int:
    """Bytes held by ``roots`` and everything they reach, each object once (code, classes and
    callables not followed: a callback's closure is not its holder's state)."""
    seen: set[int] = set()
    stack = list(roots)
    total = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _NOT_STATE):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total
