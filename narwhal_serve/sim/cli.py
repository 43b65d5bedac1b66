"""``narwhal-sim``: run one simulated engine with uvicorn."""

from __future__ import annotations

import argparse
import signal

import uvicorn

from narwhal_serve.config.sim import FAULT_NAMES, SimEngineConfig
from narwhal_serve.sim.server import bind_socket, uvicorn_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="narwhal-sim", description="Simulated vLLM-compatible engine")
    d = SimEngineConfig()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default=d.name)
    p.add_argument("--role", choices=["prefill", "decode", "unified"], default=d.role)
    p.add_argument("--dialect", choices=["vllm", "sglang", "openai"], default=d.dialect)
    p.add_argument("--model", default=d.model)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--prefill-overhead-s", type=float, default=d.prefill_overhead_s)
    p.add_argument("--prefill-per-token-s", type=float, default=d.prefill_per_token_s)
    p.add_argument("--tpot-base-s", type=float, default=d.tpot_base_s)
    p.add_argument("--tpot-per-running-s", type=float, default=d.tpot_per_running_s)
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--kv-block-size", type=int, default=d.kv_block_size)
    p.add_argument("--prefill-mode", choices=["serial", "parallel"], default=d.prefill_mode)
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks)
    p.add_argument("--eos-prob", type=float, default=d.eos_prob)
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV-cache events here as vLLM does (ZMQ PUB), e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-events-replay-endpoint", default=None, help="the replay (ROUTER) socket of those events")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="priority: waiting requests by their `priority` (vLLM's --scheduling-policy)")
    p.add_argument("--fault", action="append", default=[], choices=sorted(FAULT_NAMES),
                   help="engine-wide fault (repeatable)")
    return p


def config_from_args(ns: argparse.Namespace) -> SimEngineConfig:
    fields = set(SimEngineConfig.model_fields) - {"faults"}
    return SimEngineConfig(**{k: v for k, v in vars(ns).items() if k in fields}, faults=list(ns.fault),
                           priority_scheduling=ns.scheduling_policy == "priority")


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    cfg = config_from_args(ns)
    sock = bind_socket(ns.host, ns.port)
    config, engine = uvicorn_config(cfg, ns.host, sock.getsockname()[1])
    # uvicorn stops on SIGTERM, then raises it again under the handler it found: with the default
    # one the process ended there, and the engine's KV-event socket files stayed behind
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.shutdown()  # its KV-event sockets closed and their files removed


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
