"""How long after SIGKILL a process's TCP peer sees the connection close, by the size of the killed
process's memory (docs/contract.md, "Mid-stream resume").

Linux frees a dying process's memory before it closes its files, so a router learns that a killed
engine died only once the engine's address space is gone.  Each trial starts a child that touches
``MB`` MiB, connects back, and is killed; the time from ``kill`` to the parent's EOF is printed.

    .venv/bin/python scripts/kill_to_eof.py [MB ...]     # default: 10 1000 3000, three trials each
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

CHILD = """
import socket, sys
buf = bytearray({mb} * 1024 * 1024)
for i in range(0, len(buf), 4096):
    buf[i] = 1
s = socket.create_connection(("127.0.0.1", {port}))
s.sendall(b"r")
s.recv(1)
"""


def trial(mb: int) -> float:
    """Milliseconds from SIGKILL to EOF, for a child holding ``mb`` MiB."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        child = subprocess.Popen([sys.executable, "-c", CHILD.format(mb=mb, port=srv.getsockname()[1])])
        srv.settimeout(120)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(120)
            assert conn.recv(1) == b"r"
            t0 = time.monotonic()
            os.kill(child.pid, signal.SIGKILL)
            assert conn.recv(1) == b""
            took = time.monotonic() - t0
        child.wait()
    return 1000 * took


def main(argv: list[str]) -> None:
    for mb in [int(a) for a in argv] or [10, 1000, 3000]:
        print(f"{mb} MiB: " + ", ".join(f"{trial(mb):.1f}" for _ in range(3)) + " ms from SIGKILL to the peer's EOF")


if __name__ == "__main__":
    main(sys.argv[1:])
