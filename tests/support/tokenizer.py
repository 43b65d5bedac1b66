"""The e2e engine's tokenizer (the tiny model's byte-level BPE and chat template), built into a
directory with the router's own packages: the same ``tokenizer.json`` as ``scripts/vllm_cpu_engine.py
build-model`` writes, without torch or the vLLM venv."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scripts import tiny_llama_builder
from scripts.vllm_cpu_engine import MODEL_SPEC


def build_tiny_tokenizer(out_dir: Path) -> Path:
    if not (out_dir / "tokenizer.json").is_file():
        tiny_llama_builder.build_tokenizer(out_dir, MODEL_SPEC)
    return out_dir


@contextlib.contextmanager
def prompt_threads(tok: Any) -> Iterator[list[str]]:
    """The names of the threads ``tok.prompt`` runs on while the block runs (in call order)."""
    threads: list[str] = []
    real = tok.prompt

    def spy(route: str, body: dict[str, Any]) -> Any:
        threads.append(threading.current_thread().name)
        return real(route, body)

    tok.prompt = spy
    try:
        yield threads
    finally:
        del tok.prompt
