"""Ports for servers this process starts: outside the kernel's ephemeral range, and never handed out
twice by this process (``bind(0)`` reports a port free that a connection opened meanwhile can take:
seen in CI).  Used by the bench, the tests, the helper scripts and the managed-engine replicas.  And
the Unix socket files of ``ipc://`` endpoints: what a server leaves behind."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from pathlib import Path

_HANDED_OUT: set[int] = set()
_RANGE = (20000, 32000)  # below Linux's ephemeral ports (32768-60999), above Ray's worker ports (10002-19999)


def _ephemeral() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the kernel's ephemeral range, and never handed out
    before by this process.

    Outside the ephemeral range: a server (vLLM, Serve's proxy) binds its port seconds after it
    is chosen, and meanwhile Ray and the engines open connections and listeners on ephemeral
    ports, one of which can take a port that ``bind(0)`` had just reported free (seen in CI:
    Serve's proxy "Failed to bind"). Never handed out: two servers started back to back must not
    be told the same port. Falls back to ``bind(0)`` if the range has nothing free.
    """
    lo, hi = _RANGE
    elo, ehi = _ephemeral()
    if not (hi <= elo or lo > ehi):  # the ephemeral range overlaps ours: take what is below it
        hi = min(hi, elo)
    if hi - lo > 100:
        start = int.from_bytes(os.urandom(4), "big") % (hi - lo)
        for i in range(hi - lo):
            port = lo + (start + i) % (hi - lo)
            if port not in _HANDED_OUT and _bindable(host, port):
                _HANDED_OUT.add(port)
                return port
    for _ in range(1000):
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port on {host} that this process has not handed out already")


def free_port_run(n: int, start: int = 20000, stop: int = 60000) -> int:
    """The first port p such that p..p+n-1 are all free on 127.0.0.1 and not handed out by
    :func:`free_port` (a simulated fleet's ports); they count as handed out from then on."""
    p = start
    while p + n < stop:
        socks: list[socket.socket] = []
        try:
            if _HANDED_OUT.intersection(range(p, p + n)):
                raise OSError("handed out")
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p + i))
            _HANDED_OUT.update(range(p, p + n))
            return p
        except OSError:
            p += n
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port run")


def ipc_paths(endpoints: Iterable[str]) -> tuple[str, ...]:
    """The files of the ``ipc://`` endpoints among ``endpoints``: the Unix sockets a publisher binds,
    which it leaves behind when killed, and which ZMQ does not remove when it closes them."""
    return tuple(e.removeprefix("ipc://") for e in endpoints if e.startswith("ipc://"))


def socket_files(paths: Iterable[str]) -> tuple[tuple[str, tuple[int, int, int]], ...]:
    """``paths`` that exist now, each with what tells that file from a later one at the same path
    (device, inode and change time: an inode freed is soon given to the next file there)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.append((path, (st.st_dev, st.st_ino, st.st_ctime_ns)))
    return tuple(out)


def remove_socket_files(files: Iterable[tuple[str, tuple[int, int, int]]]) -> None:
    """Each of :func:`socket_files`' files removed, unless it is another file now (a publisher bound
    the same endpoint since: its socket stays).  Call once: a second call could take a later file
    for the one removed."""
    for path, ident in files:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino, st.st_ctime_ns) == ident:
                os.unlink(path)
