"""One managed engine process, without Ray: the simulated engine started, found ready, checked,
killed; start-up failures explained with the log's tail; the whole process group stopped; the
guard that takes the engine down with a replica that dies outright."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from narwhal_serve.managed.command import engine_argv, engine_env, guard_prefix, guarded
from narwhal_serve.managed.process import EngineDown, EngineProcess, EngineStartError
from narwhal_serve.config.launch import LaunchSpec
from tests.support.net import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, prctl")


def sim_process(tmp_path: Path, name: str = "sim-a") -> tuple[EngineProcess, str]:
    port = free_port()
    spec = LaunchSpec(kind="sim")
    argv = engine_argv(spec, name=name, model="narwhal-sim", role="unified", dialect="vllm", host="127.0.0.1",
                       port=port, python=sys.executable)
    env = engine_env(spec, os.environ, current_python=sys.executable)
    proc = EngineProcess(name, argv, env, tmp_path / f"{name}.log", prefix=guard_prefix(os.getpid(), sys.executable))
    return proc, f"http://127.0.0.1:{port}"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_sim_engine_ready_checked_killed_and_seen_dead(tmp_path: Path) -> None:
    proc, url = sim_process(tmp_path)
    await proc.start()
    try:
        ready_s = await proc.wait_ready(url, timeout_s=60)
        assert 0 < ready_s < 60
        await proc.check(url, timeout_s=5)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"narwhal_serve.sim.cli" in cmdline  # the guard exec'd the engine: same pid
        os.kill(proc.pid or 0, signal.SIGKILL)
        rc = await asyncio.wait_for(proc.wait_exit(), 10)
        assert rc == -signal.SIGKILL and not proc.alive()
        assert "was killed by SIGKILL" in proc.describe_exit()
        with pytest.raises(EngineDown, match="killed by SIGKILL"):
            await proc.check(url, timeout_s=5)
    finally:
        await proc.stop(grace_s=5)
    head = (tmp_path / "sim-a.log").read_text().splitlines()[0]
    assert head.startswith("$ " + sys.executable + " -m narwhal_serve.sim.cli")  # the engine's command, unguarded


async def test_an_engine_that_exits_early_fails_with_its_log_tail(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('cannot load model /nope'); sys.exit(3)"]
    proc = EngineProcess("bad", argv, os.environ, tmp_path / "bad.log")
    await proc.start()
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as exc:
        await proc.wait_ready("http://127.0.0.1:9", timeout_s=60)
    assert time.monotonic() - t0 < 10  # the exit ends the wait, not the timeout
    msg = str(exc.value)
    assert "exited with status 3 before its /health answered" in msg and "cannot load model /nope" in msg
    await proc.stop()


async def test_an_engine_that_never_answers_times_out_naming_the_key(tmp_path: Path) -> None:
    proc = EngineProcess("mute", [sys.executable, "-c", "import time; time.sleep(60)"], os.environ,
                         tmp_path / "mute.log")
    await proc.start()
    try:
        with pytest.raises(EngineStartError, match="launch.ready_timeout_s"):
            await proc.wait_ready(f"http://127.0.0.1:{free_port()}", timeout_s=1.0, every_s=0.2)
    finally:
        await proc.stop(grace_s=2)
    assert not proc.alive()


async def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              f" open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    proc = EngineProcess("tree", [sys.executable, "-c", script], os.environ, tmp_path / "tree.log")
    await proc.start()
    while not pid_file.exists() or not pid_file.read_text():
        await asyncio.sleep(0.05)
    child = int(pid_file.read_text())
    await proc.stop(grace_s=5)
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not alive(child) and not proc.alive()


def test_guard_takes_the_engine_down_when_its_parent_dies(tmp_path: Path) -> None:
    """A replica killed outright never runs __del__: its engine must not outlive it."""
    pid_file = tmp_path / "engine.pid"
    engine = [sys.executable, "-c", "import time; time.sleep(60)"]
    parent = (
        "import os, subprocess, sys, time\n"
        f"argv = {guarded(engine, 0, sys.executable)!r}\n"
        "argv[4] = str(os.getpid())\n"
        "p = subprocess.Popen(argv, start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(1.0)\n"
        "os._exit(0)\n"  # dies without stopping its child
    )
    subprocess.run([sys.executable, "-c", parent], check=True, timeout=30)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the engine outlived its parent"


def _kv_sim(tmp_path: Path, cleanup: bool) -> tuple[EngineProcess, str, tuple[Path, ...]]:
    from narwhal_serve.ports import ipc_paths

    port = free_port()
    ends = (f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    spec = LaunchSpec(kind="sim")
    argv = engine_argv(spec, name="sim-kv", model="narwhal-sim", role="unified", dialect="vllm", host="127.0.0.1",
                       port=port, python=sys.executable, kv_events=ends)
    proc = EngineProcess("sim-kv", argv, engine_env(spec, os.environ, current_python=sys.executable),
                         tmp_path / "sim-kv.log", prefix=guard_prefix(os.getpid(), sys.executable),
                         leftovers=ipc_paths(ends) if cleanup else ())
    return proc, f"http://127.0.0.1:{port}", (tmp_path / "pub", tmp_path / "replay")


async def test_a_stopped_engine_leaves_no_kv_event_sockets(tmp_path: Path) -> None:
    """A managed engine's KV events on ipc:// endpoints are Unix socket files (ZMQ does not remove
    them at close): an engine killed, or a simulated one stopped by SIGTERM, left them behind, one
    pair per engine start (90 in /tmp after a day of runs here).  The process's owner removes them
    once the engine has exited; the simulator, stopped, removes its own."""
    proc, url, files = _kv_sim(tmp_path, cleanup=True)
    assert proc.leftovers == tuple(str(f) for f in files)
    await proc.start()
    try:
        await proc.wait_ready(url, timeout_s=60)
        assert all(f.exists() for f in files)  # bound
        os.kill(proc.pid or 0, signal.SIGKILL)  # (a killed engine closes nothing)
        await asyncio.wait_for(proc.wait_exit(), 10)
        assert all(f.exists() for f in files)
    finally:
        await proc.stop(grace_s=5)
    assert not any(f.exists() for f in files)
    # another engine's socket bound there since (its inode likely the one freed) survives the
    # second stop() (the replica's, after the one when its engine exited)
    import socket

    later = socket.socket(socket.AF_UNIX)
    later.bind(str(files[0]))
    try:
        await proc.stop(grace_s=1)
        assert files[0].exists()
    finally:
        later.close()
        files[0].unlink()
    proc, url, files = _kv_sim(tmp_path, cleanup=False)
    await proc.start()
    try:
        await proc.wait_ready(url, timeout_s=60)
        assert all(f.exists() for f in files)
    finally:
        await proc.stop(grace_s=10)  # SIGTERM
    assert proc.returncode is not None and not any(f.exists() for f in files)


async def test_an_engine_that_dies_before_it_is_ready_leaves_no_kv_event_sockets(tmp_path: Path) -> None:
    """An engine that binds its KV-event sockets and then exits (or is killed) before its /health
    ever answers: its socket files were recorded only once it was ready, so they stayed.  Now what
    it made at its paths is removed when it is stopped; a file that was there before it started
    is not its own and stays."""
    from narwhal_serve.ports import ipc_paths

    ends = (f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    files = (tmp_path / "pub", tmp_path / "replay")
    binds = (  # binds both, as a publisher does, then fails at start-up (a killed one closes nothing)
        "import os, socket, sys\n"
        "for p in sys.argv[1:]:\n"
        "    socket.socket(socket.AF_UNIX).bind(p)\n"
        "os._exit(3)\n"
    )
    proc = EngineProcess("dies", [sys.executable, "-c", binds, *map(str, files)], dict(os.environ),
                         tmp_path / "dies.log", leftovers=ipc_paths(ends))
    await proc.start()
    try:
        with pytest.raises(EngineStartError, match="exited with status 3"):
            await proc.wait_ready(f"http://127.0.0.1:{free_port()}", timeout_s=30)
        assert all(f.exists() for f in files)
    finally:
        await proc.stop(grace_s=1)
    assert not any(f.exists() for f in files)
    # a file at one of its paths before it started (another's) is left where it is
    import socket

    other = socket.socket(socket.AF_UNIX)
    other.bind(str(files[0]))
    try:
        proc = EngineProcess("dies", [sys.executable, "-c", binds, str(files[1])], dict(os.environ),
                             tmp_path / "dies.log", leftovers=ipc_paths(ends))
        await proc.start()
        with pytest.raises(EngineStartError):
            await proc.wait_ready(f"http://127.0.0.1:{free_port()}", timeout_s=30)
        await proc.stop(grace_s=1)
        assert files[0].exists() and not files[1].exists()
    finally:
        other.close()
        files[0].unlink()
