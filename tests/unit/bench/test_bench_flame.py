"""Reading py-spy's Chrome traces back into timed stacks (narwhal_serve.bench.flame), on synthetic
events and on a real py-spy recording of a process that alternates work and sleep."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from narwhal_serve.bench import flame


def _ev(ph: str, name: str, ts: int, tid: int = 1, file: str = "/x/app.py") -> dict[str, object]:
    return {"ph": ph, "name": name, "ts": ts, "tid": tid, "pid": 9, "cat": "py-spy", "args": {"filename": file}}


def _trace() -> list[dict[str, object]]:
    # thread 1: main→work for 0-30 ms, main→Condition.wait 30-100 ms, main→work 100-120 ms
    # thread 2: a selector wait the whole time
    return [
        {"ph": "M", "name": "thread_name", "ts": 0, "tid": 1, "pid": 9, "args": {"filename": "", "name": "1: main"}},
        _ev("B", "main", 0), _ev("B", "work", 0),
        _ev("B", "EpollSelector.select", 0, tid=2, file="/usr/lib/selectors.py"),
        _ev("E", "work", 30_000), _ev("B", "Condition.wait", 30_000, file="/usr/lib/threading.py"),
        _ev("E", "Condition.wait", 100_000, file="/usr/lib/threading.py"), _ev("B", "work", 100_000),
        _ev("E", "work", 120_000), _ev("E", "main", 120_000),
        _ev("E", "EpollSelector.select", 120_000, tid=2, file="/usr/lib/selectors.py"),
    ]


def test_spans_rebuild_each_threads_stack_and_tell_waiting_from_busy() -> None:
    spans = flame.spans(_trace())
    busy = [(s.stack, s.start_us, s.end_us) for s in spans if not s.waiting]
    assert busy == [(("main (app.py)", "work (app.py)"), 0, 30_000), (("main (app.py)", "work (app.py)"), 100_000, 120_000)]
    waiting = {s.stack[-1] for s in spans if s.waiting}
    assert waiting == {"Condition.wait (threading.py)", "EpollSelector.select (selectors.py)"}
    assert flame.busy_us(spans) == 50_000


def test_folded_counts_samples_and_cuts_spans_at_windows() -> None:
    spans = flame.spans(_trace())
    period = 10_000.0  # 100 Hz
    assert flame.folded(spans, period) == {"main (app.py);work (app.py)": 5}
    assert flame.folded(spans, period, busy_only=False)["main (app.py);Condition.wait (threading.py)"] == 7
    t0 = 1000.0  # wall time of timestamp 0
    # a window over 20-110 ms holds 10 ms of the first work span and 10 ms of the second
    inside = flame.folded(spans, period, windows=[(t0 + 0.020, t0 + 0.110)], offset_wall=t0)
    assert inside == {"main (app.py);work (app.py)": 2}
    assert flame.busy_us(spans, [(t0 + 0.020, t0 + 0.110)], t0) == 20_000
    assert flame.folded(spans, period, windows=[(t0 + 0.040, t0 + 0.090)], offset_wall=t0) == {}


def test_calibrate_takes_the_stop_minus_the_last_stamp_never_before_the_spawn() -> None:
    spans = flame.spans(_trace())
    assert flame.calibrate(spans, stopped_wall=500.0, spawned_wall=400.0) == pytest.approx(500.0 - 0.12)
    assert flame.calibrate(spans, stopped_wall=500.0, spawned_wall=499.95) == 499.95


def test_top_frames_and_svg() -> None:
    stacks = {"a (m.py);b (m.py)": 3, "a (m.py);c <&> (m.py)": 1}
    assert flame.top_frames(stacks, own=True) == [("b (m.py)", 0.75), ("c <&> (m.py)", 0.25)]
    assert dict(flame.top_frames(stacks))["a (m.py)"] == 1.0
    root = ET.fromstring(flame.svg(stacks, "t"))  # well-formed, names escaped
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert "a (m.py): 4 samples (100.0 %)" in titles and "c <&> (m.py): 1 samples (25.0 %)" in titles


_WORKER = """
import time
def work():
    t = time.perf_counter()
    while time.perf_counter() - t < 0.03:
        pass
def rest():
    time.sleep(0.07)
print("ready", flush=True)
while True:
    work()
    rest()
"""


def _py_spy() -> str | None:
    near = Path(sys.executable).parent / "py-spy"
    return str(near) if near.exists() else shutil.which("py-spy")


@pytest.mark.skipif(_py_spy() is None, reason="py-spy is not installed (the bench extra)")
def test_a_real_py_spy_trace_reads_as_the_duty_cycle_it_sampled(tmp_path: Path) -> None:
    """30 ms of work, 70 ms of sleep: the busy share read back is about 30 %, and the sleeping
    stack (``rest``, whose blocking call is C) is told apart by the run's own frames."""
    proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
        out = tmp_path / "t.json"
        spawned = time.time()
        spy = subprocess.Popen([str(_py_spy()), "record", "--pid", str(proc.pid), "--rate", "200", "--idle",
                                "--nonblocking", "--format", "chrometrace", "--output", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and spy.poll() is None:  # py-spy attached and sampling
            if out.exists():
                break
            try:
                spy.wait(timeout=1.5)
            except subprocess.TimeoutExpired:
                break
        stopped = time.time()
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=30)
        if not out.exists():
            pytest.skip(f"py-spy could not attach here: {err.decode(errors='replace')[-200:]}")
    finally:
        proc.kill()
        proc.wait()
    spans = flame.spans(__import__("json").loads(out.read_text()))
    work = sum(s.us for s in spans if s.stack and s.stack[-1].startswith("work "))
    rest = sum(s.us for s in spans if s.stack and s.stack[-1].startswith("rest "))
    assert work > 0 and rest > 0
    assert 0.15 < work / (work + rest) < 0.45
    t0 = flame.calibrate(spans, stopped, spawned)
    assert spawned <= t0 <= stopped


def test_read_raw_drops_line_numbers(tmp_path: Path) -> None:
    p = tmp_path / "r.txt"
    p.write_text("<module> (app.py:9);work (app.py:4) 16\n<module> (app.py:9);work (app.py:5) 2\nrun (a:b.py:3) 1\n")
    assert flame.read_raw(p) == {"<module> (app.py);work (app.py)": 18, "run (a:b.py)": 1}
