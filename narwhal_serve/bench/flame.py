"""What a process ran, and when: py-spy's Chrome-trace output read back into timed stack samples,
folded stacks, flame graphs (SVG) and the stacks that ran inside given time windows.

py-spy ``record --format chrometrace`` writes, per thread, a ``B`` event when a frame enters the
sampled stack and an ``E`` when it leaves; consecutive samples with the same stack are merged.
Without ``--idle`` a dropped idle sample does not break the merge, so one span can cover seconds of
waiting (and py-spy's own idle test, the thread's OS state, also drops samples in the middle of a
system call).  ``narwhal-bench profile`` therefore records with ``--idle`` (every sample is a
stack) and this module classifies a stack as waiting by its innermost frame (:data:`WAIT_LEAVES`:
the Python frame that called a blocking C function).  A thread's timeline is then exact to the
sampling period, up to what that rule cannot see: a thread waiting for the GIL looks busy, and C
work with no Python frame above it (uvloop between callbacks, Ray's C++ core worker, gRPC's C
threads, the kernel) looks idle or is not sampled at all.

Timestamps are microseconds since py-spy started sampling; :func:`calibrate` turns them into wall
time from the moment the recording was stopped (SIGINT) and the last timestamp written.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the innermost Python frame (py-spy's qualified name) of a thread that is waiting, not computing:
# it called into C code that blocks.  ``Thread.run`` innermost: the thread's target is C (Ray runs
# each replica's uvloop with ``target=loop.run_forever``; uvloop's own C work between callbacks
# counts as waiting too, a known undercount); ``Worker.main_loop``: Ray's C++ core worker loop;
# ``_worker``: an idle thread-pool thread in ``SimpleQueue.get``; the rest are selectors, locks,
# conditions, sleeps and joins
WAIT_LEAVES = frozenset({
    "Thread.run", "Worker.main_loop", "_worker", "Condition.wait", "_PollLikeSelector.select", "Event.wait", "Semaphore.acquire",
    "Thread._wait_for_tstate_lock", "Thread.join", "Queue.get", "EpollSelector.select", "PollSelector.select",
    "SelectSelector.select", "KqueueSelector.select", "DevpollSelector.select", "BaseServer.serve_forever",
    "socket.accept", "SocketIO.readinto", "sleep", "select", "poll", "wait", "main_loop", "run_forever",
})


@dataclass(frozen=True)
class Span:
    """One stretch of consecutive samples of one thread with one stack (outermost frame first)."""

    tid: int
    stack: tuple[str, ...]
    start_us: int
    end_us: int

    @property
    def waiting(self) -> bool:
        if not self.stack:
            return True
        if len(self.stack) == 1 and self.stack[0].endswith("(<string>)"):
            return True  # a thread whose whole Python stack is a generated target (Ray's): it sits in C
        return self.stack[-1].split(" (", 1)[0] in WAIT_LEAVES

    @property
    def us(self) -> int:
        return self.end_us - self.start_us


def _frame(e: dict[str, Any]) -> str:
    """``name (file.py)``, as py-spy's raw format names a frame (there, less the line)."""
    f = str(e.get("args", {}).get("filename", ""))
    return f"{e.get('name', '?')} ({f.rsplit('/', 1)[-1] or '?'})"


def read_raw(path: Path) -> dict[str, int]:
    """py-spy's ``--format raw`` (folded stacks, ``name (file.py:line)`` frames), line numbers
    dropped so stacks compare with :func:`folded`'s.  Without ``--idle`` py-spy leaves out samples
    of threads the OS has asleep (a sleep, a poll, a lock, but also any blocking system call): the
    right filter for what a process does with no traffic, where nothing is timed."""
    out: dict[str, int] = defaultdict(int)
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out[";".join(_no_line(f) for f in stack.split(";"))] += int(n)
    return dict(out)


def _no_line(frame: str) -> str:
    i = frame.rfind(" (")
    j = frame.rfind(":")
    return frame[:j] + ")" if i >= 0 and j > i and frame.endswith(")") else frame


def spans(events: Sequence[dict[str, Any]]) -> list[Span]:
    """Rebuild each thread's stack over time from B/E events (in file order, which is time order)."""
    stacks: dict[int, list[str]] = defaultdict(list)
    since: dict[int, int] = {}
    out: list[Span] = []
    for e in events:
        ph = e.get("ph")
        if ph not in ("B", "E"):
            continue
        tid, ts = int(e.get("tid", 0)), int(e.get("ts", 0))
        st = stacks[tid]
        if tid in since and st and ts > since[tid]:
            out.append(Span(tid, tuple(st), since[tid], ts))
        since[tid] = ts
        if ph == "B":
            st.append(_frame(e))
        elif st:
            st.pop()
    return out


def load(path: Path) -> list[Span]:
    raw = json.loads(path.read_text() or "[]")
    return spans(raw if isinstance(raw, list) else raw.get("traceEvents", []))


def calibrate(spans_: Sequence[Span], stopped_wall: float, spawned_wall: float) -> float:
    """Wall time of timestamp 0.  py-spy stamps its final ``E`` events when it stops on SIGINT
    (``stopped_wall``), so ``stopped_wall - last / 1e6`` is a lower bound that errs by the time
    py-spy took to notice the signal (at most one sampling period); never before the spawn."""
    last = max((s.end_us for s in spans_), default=0)
    return max(spawned_wall, stopped_wall - last / 1e6)


def folded(spans_: Iterable[Span], period_us: float, *, busy_only: bool = True,
           windows: Sequence[tuple[float, float]] | None = None, offset_wall: float = 0.0) -> dict[str, int]:
    """``{"outer;...;inner": samples}`` (Brendan Gregg's folded format), optionally only the parts
    of spans inside ``windows`` (wall-clock ``(start, end)`` pairs; ``offset_wall`` = :func:`calibrate`)."""
    out: dict[str, int] = defaultdict(int)
    for s in spans_:
        if busy_only and s.waiting:
            continue
        us = s.us if windows is None else _overlap_us(s, windows, offset_wall)
        if us > 0:
            out[";".join(s.stack)] += max(1, round(us / period_us))
    return dict(out)


def _overlap_us(s: Span, windows: Sequence[tuple[float, float]], offset_wall: float) -> int:
    a, b = offset_wall + s.start_us / 1e6, offset_wall + s.end_us / 1e6
    return round(sum(max(0.0, min(b, w1) - max(a, w0)) for w0, w1 in windows) * 1e6)


def busy_us(spans_: Iterable[Span], windows: Sequence[tuple[float, float]] | None = None,
            offset_wall: float = 0.0) -> int:
    """Microseconds of busy samples (all threads summed), optionally inside ``windows``."""
    return sum(s.us if windows is None else _overlap_us(s, windows, offset_wall)
               for s in spans_ if not s.waiting)


def write_folded(path: Path, stacks: dict[str, int]) -> Path:
    path.write_text("".join(f"{k} {v}\n" for k, v in sorted(stacks.items(), key=lambda kv: -kv[1])))
    return path


def top_frames(stacks: dict[str, int], n: int = 12, own: bool = False) -> list[tuple[str, float]]:
    """The frames with the largest share of samples: inclusive (on the stack) or ``own`` (innermost)."""
    total = sum(stacks.values()) or 1
    acc: dict[str, int] = defaultdict(int)
    for k, v in stacks.items():
        frames = k.split(";")
        for f in ([frames[-1]] if own else set(frames)):
            acc[f] += v
    return [(f, round(v / total, 4)) for f, v in sorted(acc.items(), key=lambda kv: -kv[1])[:n]]


# -- SVG flame graph ----------------------------------------------------------------------------

_ROW = 16
_WIDTH = 1200


def _tree(stacks: dict[str, int]) -> dict[str, Any]:
    root: dict[str, Any] = {"n": 0, "kids": {}}
    for k, v in stacks.items():
        node = root
        node["n"] += v
        for f in k.split(";"):
            node = node["kids"].setdefault(f, {"n": 0, "kids": {}})
            node["n"] += v
    return root


def svg(stacks: dict[str, int], title: str) -> str:
    """A static flame graph: the outermost frame at the bottom, widths proportional to samples,
    a tooltip (``<title>``) on every frame with its samples and share."""
    root = _tree(stacks)
    total = root["n"] or 1
    scale = (_WIDTH - 20) / total
    boxes: list[tuple[float, float, int, str, int]] = []  # x, width, depth, frame, samples

    def walk(kids: dict[str, Any], x: float, depth: int) -> None:
        for name, kid in sorted(kids.items()):
            w = kid["n"] * scale
            if w >= 0.3:
                boxes.append((x, w, depth, name, kid["n"]))
                walk(kid["kids"], x, depth + 1)
            x += w

    walk(root["kids"], 0.0, 0)
    depth_max = max((b[2] for b in boxes), default=0)
    height = (depth_max + 3) * _ROW + 20
    rects = []
    for x, w, depth, name, n in boxes:
        y = height - (depth + 2) * _ROW
        hue = 10 + (sum(map(ord, name)) % 50)
        text = html.escape(name[: int(w / 7)]) if w > 21 else ""
        rects.append(f'<g><title>{html.escape(name)}: {n} samples ({100 * n / total:.1f} %)</title>'
                     f'<rect x="{10 + x:.1f}" y="{y}" width="{w:.1f}" height="{_ROW - 1}" '
                     f'fill="hsl({hue},90%,60%)"/><text x="{13 + x:.1f}" y="{y + _ROW - 4}">{text}</text></g>')
    body = "\n".join(rects)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
            f'font-family="monospace" font-size="11">\n<rect width="100%" height="100%" fill="#fff"/>\n'
            f'<text x="10" y="16" font-size="13">{html.escape(title)} — {total} samples</text>\n{body}\n</svg>\n')
