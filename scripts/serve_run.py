"""The run command: `serve run <config>` under a small supervisor that always stops it cleanly.

    python scripts/serve_run.py [serve run args...]     # default: serve_config.yaml

Why: in HA-proxy ("direct ingress") mode Ray Serve's HAProxyManager actor starts HAProxy as a plain
child process (`haproxy -db -f /tmp/haproxy-serve/<node_id>/haproxy.cfg`, in the actor's own process
group). `serve run` only stops it on its KeyboardInterrupt path (`serve.shutdown()`: the controller
drains the replicas and calls the manager's `shutdown()`, which kills HAProxy). SIGTERM -- what
systemd and Kubernetes send -- instead hits Ray's C++ signal handler in the driver (the process
aborts), the raylet and GCS die with it, and whether HAProxy is reaped depends on who notices first;
when it is not, it stays, orphaned, bound to the router's port and to *:8404 / *:9101, and the next
start fails with "Failed to bind".

So this script starts `serve run` as a child in its own process group, with the Ray environment the
project needs (`setdefault`: a caller may override any of it), and on SIGTERM, SIGINT or SIGHUP sends
the child one SIGINT (the path that shuts down cleanly), waits (bounded, NARWHAL_STOP_TIMEOUT_S,
default 60 s), and then makes sure nothing it started is left: every process of *this* run carries
NARWHAL_SERVE_RUN_ID=<id> in its environment (Ray passes the driver's environment to the raylet, its
workers, and so to HAProxy), and HAProxy's command line names this run's own config folder. Those
left are sent SIGTERM, then SIGKILL. Processes of other Ray sessions on the machine carry neither,
whatever their name. A second signal (more than 1 s after the first) skips the wait: force stop.

SIGTERM drains first (a rolling restart must not drop the answers in progress): every application
of the config is told `POST /admin/drain {"grace_s": serving.drain_grace_s}` (default 30 s) with the
admin token from its `admin.token_env` -- set here to a random one when the operator set none --, so
it admits nothing new (503 `router_unavailable`, `Retry-After: 1`, `/ready` 503 `draining`) while
the requests in flight finish; streams still open when the grace period ends are ended by the
ingress with an error event and `[DONE]`. Once no application holds a request (their `/status`
gauges), or the grace period and a short flush have passed, the SIGINT above follows.
NARWHAL_DRAIN=0 skips the drain; a second signal ends it at once; SIGINT and SIGHUP do not drain.

In direct ingress, HAProxy refuses an `Expect: 100-continue` over `serving.max_request_bytes`,
waits `serving.body_timeout_s` for such a body, and drops a client it waits on longer than the
router's own body and slow-reader limits: the run reads those from every application of its config
(the most permissive; `narwhal_serve.runenv.IngressLimits`).

Several Ray sessions on one machine in this mode need distinct ports (the router's http port, the
sim's base_port, RAY_SERVE_HAPROXY_STATS_PORT (8404), RAY_SERVE_HAPROXY_METRICS_PORT (9101),
RAY_SERVE_FALLBACK_PROXY_HTTP_PORT (8500, bound with SO_REUSEPORT: a clash is silent, not an error));
HAProxy's files are already kept apart by node id.

Exit status: the child's (0 after a signal-driven clean stop; 128+N if it died of signal N), or 1 if
it had to be killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType

from narwhal_serve.drain import drain, drain_targets, ingress_limits
from narwhal_serve.runenv import RUN_ENV, IngressLimits, direct_ingress_env

RUN_ID_ENV = "NARWHAL_SERVE_RUN_ID"

# The environment `make run` documents, direct ingress (HA-proxy mode) included; a caller's values
# win (RAY_SERVE_ENABLE_HA_PROXY=0: Serve's proxy actor instead, docs/operations.md, "Run modes").
ENV_DEFAULTS: dict[str, str] = {
    **RUN_ENV,
    # Ray's default (30 s) keeps every ingress replica reachable for 30 s after it is told to stop,
    # for external load balancers to deregister it. Behind Serve's HAProxy the deregistration is a
    # controller broadcast plus an HAProxy reload (well under a second here), and after the window
    # the replica refuses new connections, which HAProxy retries elsewhere (`retry-on conn-failure`);
    # in-flight requests are still drained. 5 s keeps a wide margin and cuts a stop from ~33 s to ~13 s.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
}

# HAProxy's file locations (Ray appends /<node_id>/ to each folder). When the caller sets none of
# them, this run gets its own folder: HAProxy's command line then names it (one more way to find this
# run's HAProxy), and it is removed after a clean stop.
HAPROXY_PATH_VARS: dict[str, str] = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}

DEFAULT_STOP_TIMEOUT_S = 60.0
SETTLE_S = 3.0  # after the child exits: time for Ray's own processes to finish exiting by themselves
TERM_GRACE_S = 5.0  # between SIGTERM and SIGKILL for leftovers
REPEAT_WINDOW_S = 1.0  # a second signal later than this after the first forces the stop
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def log(msg: str) -> None:
    print(f"serve_run: {msg}", file=sys.stderr, flush=True)


# --- /proc helpers (Linux; also used by tests/shutdown) -----------------------------------------


def pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _read(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return None


def environ_has(pid: int, entry: str) -> bool:
    data = _read(pid, "environ")
    return data is not None and entry.encode() in data.split(b"\0")


def cmdline(pid: int) -> list[str]:
    data = _read(pid, "cmdline") or b""
    return [a.decode(errors="replace") for a in data.split(b"\0") if a]


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name: [state, ppid, pgrp, ...]."""
    data = _read(pid, "stat")
    if data is None:
        return None
    return data[data.rfind(b")") + 2 :].decode().split()


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    f = stat_fields(pid)
    return f is not None and f[0] != "Z"


def ancestors(pid: int) -> set[int]:
    out: set[int] = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        f = stat_fields(pid)
        if f is None:
            break
        pid = int(f[1])
    return out


def run_processes(run_id: str, haproxy_dir: str | None = None, pgid: int | None = None) -> list[int]:
    """Live processes of one run: its environment marker, its HAProxy folder, or its process group.
    Never this process or its ancestors."""
    exclude = ancestors(os.getpid())
    marker = f"{RUN_ID_ENV}={run_id}"
    found = []
    for pid in pids():
        if pid in exclude or not alive(pid):
            continue
        f = stat_fields(pid)
        if (
            environ_has(pid, marker)
            or (pgid is not None and f is not None and int(f[2]) == pgid)
            or (haproxy_dir is not None and any(haproxy_dir in a for a in cmdline(pid)))
        ):
            found.append(pid)
    return found


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def listening() -> dict[int, set[tuple[str, int]]]:
    """TCP listeners: port -> {(address, pid)} (pid -1 where the owner is not visible)."""
    by_inode: dict[str, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A = LISTEN
                continue
            addr_hex, port_hex = cols[1].rsplit(":", 1)
            by_inode[cols[9]] = (_addr(addr_hex), int(port_hex, 16))
    owners: dict[str, int] = {}
    for pid in pids():
        for inode in _socket_inodes(pid) & by_inode.keys():
            owners[inode] = pid
    out: dict[int, set[tuple[str, int]]] = {}
    for inode, (addr, port) in by_inode.items():
        out.setdefault(port, set()).add((addr, owners.get(inode, -1)))
    return out


def _addr(h: str) -> str:
    if len(h) == 8:
        return ".".join(str(b) for b in reversed(bytes.fromhex(h)))
    if h == "0" * 32:
        return "::"
    words = [bytes.fromhex(h[i : i + 8])[::-1].hex() for i in range(0, 32, 8)]
    v6 = "".join(words)
    if v6.startswith("0" * 20 + "ffff"):
        return "::ffff:" + ".".join(str(b) for b in bytes.fromhex(v6[24:]))
    return ":".join(v6[i : i + 4] for i in range(0, 32, 4))


# --- the supervisor ------------------------------------------------------------------------------


def _serve_command(args: list[str]) -> list[str]:
    serve = Path(sys.executable).with_name("serve")
    exe = str(serve) if serve.exists() else shutil.which("serve")
    if exe is None:
        raise SystemExit("serve_run: the `serve` command (ray[serve]) is not installed")
    return [exe, "run", *(args or ["serve_config.yaml"])]


def build_env(base: dict[str, str], limits: IngressLimits) -> tuple[dict[str, str], str | None]:
    """The child's environment and, when this run made one, its own HAProxy folder (``limits``:
    what HAProxy enforces for the config's applications)."""
    env = dict(base)
    for k, v in ENV_DEFAULTS.items():
        env.setdefault(k, v)
    env.setdefault(RUN_ID_ENV, uuid.uuid4().hex)
    own_paths = not any(k in env for k in HAPROXY_PATH_VARS)
    ha_proxy = env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
    # the run's folder: HAProxy's paths unless the caller set its own, and the wrapper unless the
    # caller chose its own HAProxy binary (removed when the run ends)
    haproxy_dir = None
    if own_paths or (ha_proxy and not env.get("RAY_SERVE_HAPROXY_BINARY_PATH")):
        # Short: Ray adds /<56-char node id>/ and unix socket paths are limited to 107 bytes.
        haproxy_dir = tempfile.mkdtemp(prefix="narwhal-hap-", dir="/tmp")
    if own_paths:
        for k, leaf in HAPROXY_PATH_VARS.items():
            env[k] = os.path.join(haproxy_dir, leaf) if leaf else haproxy_dir
    if ha_proxy:
        # HAProxy without kernel splicing, or client disconnects go unseen (narwhal_serve.runenv)
        env = direct_ingress_env(env, limits, os.path.join(haproxy_dir, "bin") if haproxy_dir else None)
    return env, haproxy_dir


def _signal_all(pid_list: Iterable[int], sig: signal.Signals) -> None:
    for pid in pid_list:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as e:
            log(f"cannot signal {pid}: {e}")


def _wait_gone(get: Callable[[], list[int]], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = get()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = get()
    return left


def sweep(run_id: str, haproxy_dir: str | None, pgid: int | None, settle_s: float = SETTLE_S) -> list[int]:
    """Stop whatever of this run is still running; returns the pids that had to be signalled."""

    def get() -> list[int]:
        return run_processes(run_id, haproxy_dir, pgid)

    left = _wait_gone(get, settle_s)
    if not left:
        return []
    described = ", ".join(f"{p} {(_read(p, 'comm') or b'?').decode(errors='replace').strip()}" for p in left)
    log(f"{len(left)} process(es) of this run still running; SIGTERM: {described}")
    _signal_all(left, signal.SIGTERM)
    still = _wait_gone(get, TERM_GRACE_S)
    if still:
        log(f"SIGKILL: {still}")
        _signal_all(still, signal.SIGKILL)
        still = _wait_gone(get, 2.0)
        if still:
            log(f"still present after SIGKILL: {still}")
    return left


def main(argv: list[str]) -> int:
    targets = drain_targets(argv, log)
    env, haproxy_dir = build_env(dict(os.environ), ingress_limits(targets))
    for t in targets:  # the run's own admin token where the operator set none: draining needs one
        env.setdefault(t.token_env, secrets.token_hex(16))
    run_id = env[RUN_ID_ENV]
    stop_timeout_s = float(env.get("NARWHAL_STOP_TIMEOUT_S", DEFAULT_STOP_TIMEOUT_S))

    received: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)

    for s in FORWARDED:
        signal.signal(s, on_signal)

    cmd = _serve_command(argv)
    log(f"run {run_id}: {' '.join(cmd)}" + (f" (HAProxy files under {haproxy_dir})" if haproxy_dir else ""))
    try:
        child = subprocess.Popen(cmd, env=env, process_group=0)
    except OSError:
        if haproxy_dir is not None:
            shutil.rmtree(haproxy_dir, ignore_errors=True)
        raise
    rc: int | None = None
    handled = 0
    deadline: float | None = None
    t_stop: float | None = None
    drainer: threading.Thread | None = None
    forced = threading.Event()
    try:
        while True:
            try:
                rc = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if drainer is not None and not drainer.is_alive() and deadline is None:
                log(f"stopping serve (SIGINT), up to {stop_timeout_s:.0f} s")
                _signal_all([child.pid], signal.SIGINT)
                deadline = time.monotonic() + stop_timeout_s
            if len(received) > handled:
                if handled == 0:
                    t_stop = time.monotonic()
                    handled = 1
                    if received[0] == signal.SIGTERM and targets and os.environ.get("NARWHAL_DRAIN", "1") != "0":
                        # a rolling restart: requests in flight finish (docs/operations.md)
                        log("SIGTERM: draining first")
                        drainer = threading.Thread(target=drain, args=(targets, env, forced, log), daemon=True)
                        drainer.start()
                        continue
                    log(f"{signal.Signals(received[0]).name}: stopping serve (SIGINT), up to {stop_timeout_s:.0f} s")
                    _signal_all([child.pid], signal.SIGINT)
                    deadline = t_stop + stop_timeout_s
                elif t_stop is not None and time.monotonic() - t_stop < REPEAT_WINDOW_S:
                    # The same stop delivered twice (e.g. a process-group SIGTERM that `make` also
                    # forwards to its child): not a request to force.
                    handled = len(received)
                elif drainer is not None and drainer.is_alive():
                    log("second signal: draining no longer")
                    forced.set()  # the drainer returns; SIGINT follows
                    handled = len(received)
                else:
                    log("second signal: stopping now")
                    break
            if deadline is not None and time.monotonic() > deadline:
                log(f"serve did not stop within {stop_timeout_s:.0f} s")
                break
    finally:
        # Settle only after a stop of its own; when it is still running, nothing will exit by itself.
        signalled = sweep(run_id, haproxy_dir, child.pid, settle_s=SETTLE_S if rc is not None else 0.0)
        if rc is None:
            try:
                rc = child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            rc = 1  # it did not stop by itself
        if t_stop is not None:
            log(f"stopped in {time.monotonic() - t_stop:.1f} s (exit {rc})")
        if haproxy_dir is not None and rc == 0 and not signalled:
            shutil.rmtree(haproxy_dir, ignore_errors=True)
    return 128 + -rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
