"""``narwhal-sim`` argument parsing and :func:`start_server` on an explicit port."""

from __future__ import annotations

import socket

import httpx
import pytest

from narwhal_serve.sim.cli import build_parser, config_from_args
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.server import start_server


def test_cli_arguments_build_config() -> None:
    ns = build_parser().parse_args(["--port", "8123", "--role", "decode", "--dialect", "sglang", "--model", "m",
                                    "--seed", "3", "--max-num-seqs", "2", "--name", "d1", "--tpot-base-s", "0.5",
                                    "--fault", "unhealthy", "--fault", "hang"])
    cfg = config_from_args(ns)
    assert (ns.host, ns.port) == ("127.0.0.1", 8123)
    assert cfg == SimEngineConfig(name="d1", role="decode", dialect="sglang", model="m", seed=3, max_num_seqs=2,
                                  tpot_base_s=0.5, faults=["unhealthy", "hang"])
    with pytest.raises(SystemExit):
        build_parser().parse_args([])  # --port is required


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_start_server_on_explicit_port_and_busy_port() -> None:
    port = _free_port()
    srv = await start_server(SimEngineConfig(name="e1"), "127.0.0.1", port)
    try:
        assert srv.url == f"http://127.0.0.1:{port}"
        with pytest.raises(OSError):
            await start_server(SimEngineConfig(), "127.0.0.1", port)
        async with httpx.AsyncClient(base_url=srv.url, timeout=5.0) as c:
            body = {"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            kvp = (await c.post("/v1/completions", json=body)).json()["kv_transfer_params"]
        assert kvp["remote_port"] == port and kvp["remote_engine_id"] == "e1"
    finally:
        await srv.stop()
