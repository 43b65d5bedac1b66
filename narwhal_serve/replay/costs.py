"""What each part of the router that would run for real costs in a replay, as CPU time of this
process (``time.thread_time``): the scheduler's report handling (lease grants and their views
included), its admit calls, its scrapes (parsing and applying an engine's ``/metrics``, not the
simulator rendering it), its periodic work (reaping, drift, probes), the KV-event index (or, with
shards, applying their changes; each shard's own index is ``kvshard.*``), and each ingress lease's
decisions, grant applications and report cuts; and, as a report and its grant (or a shard's
changes) cross a Ray hop, their serialization each side.  Wrappers on the live objects,
so an un-costed replay pays nothing."""

from __future__ import annotations

import contextlib
import gc
import pickle
import sys
import time
import types
from collections.abc import Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Cost:
    calls: int = 0
    ns: int = 0
    samples: list[int] = field(default_factory=list)  # per call, for the parts whose percentiles matter


GC_PART = "process.gc"  # the garbage collector's passes, over the whole process's heap


@dataclass
class Costs:
    """Each part's CPU without the garbage collector's passes that fell in its calls: in a replay
    one process holds the scheduler, the shards' indexes and every lease, and a pass over that
    heap is no part's own cost (a real ingress's heap is its lease's view).  The passes are
    their own row (``process.gc``), counted while :meth:`watching_gc`."""

    parts: dict[str, Cost] = field(default_factory=dict)
    sampled: frozenset[str] = frozenset({"ingress.decide", "scheduler.admit"})
    gc_ns: int = 0  # CPU of the collector's passes so far
    _gc_at: int = 0

    def add(self, part: str, ns: int) -> None:
        c = self.parts.setdefault(part, Cost())
        c.calls += 1
        c.ns += ns
        if part in self.sampled:
            c.samples.append(ns)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_at = time.thread_time_ns()
        else:
            ns = time.thread_time_ns() - self._gc_at
            self.gc_ns += ns
            self.add(GC_PART, ns)

    @contextlib.contextmanager
    def watching_gc(self) -> Iterator[None]:
        gc.callbacks.append(self._on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(self._on_gc)

    def since(self, gc_ns: int, t_ns: int) -> int:
        """CPU since ``t_ns`` (``thread_time_ns``), without the collector's passes since ``gc_ns``."""
        return time.thread_time_ns() - t_ns - (self.gc_ns - gc_ns)

    def timed(self, part: str, fn: Callable[..., T]) -> Callable[..., T]:
        def wrapper(*args: Any, **kwargs: Any) -> T:
            g, t = self.gc_ns, time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, self.since(g, t))

        return wrapper

    def timed_async(self, part: str, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        """The CPU of each step of the coroutine (its waits not counted), as one call."""
        async def wrapper(*args: Any, **kwargs: Any) -> T:
            steps = _Steps(fn(*args, **kwargs), self)
            try:
                out: T = await steps
                return out
            finally:
                self.add(part, steps.ns)

        return wrapper

    def carried(self, obj: T, sender: str, receiver: str) -> T:
        """``obj`` across a Ray hop: pickled by ``sender`` and read by ``receiver`` (``<side>.hop``)."""
        g, t = self.gc_ns, time.thread_time_ns()
        data = pickle.dumps(obj, protocol=5)
        self.add(f"{sender}.hop", self.since(g, t))
        g, t = self.gc_ns, time.thread_time_ns()
        out: T = pickle.loads(data)
        self.add(f"{receiver}.hop", self.since(g, t))
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
    def __init__(self, coro: Awaitable[Any], costs: Costs) -> None:
        self.coro, self.costs = coro, costs
        self.ns = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self.coro.__await__()
        send: Any = None
        throw: BaseException | None = None
        while True:
            g, t = self.costs.gc_ns, time.thread_time_ns()
            try:
                out = it.send(send) if throw is None else it.throw(throw)
            except StopIteration as stop:
                self.ns += self.costs.since(g, t)
                return stop.value
            except BaseException:
                self.ns += self.costs.since(g, t)
                raise
            self.ns += self.costs.since(g, t)
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
