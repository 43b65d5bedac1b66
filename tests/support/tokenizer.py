"""The e2e engine's tokenizer (the tiny model's byte-level BPE and chat template), built into a
directory with the router's own packages: the same ``tokenizer.json`` as ``scripts/vllm_cpu_engine.py
build-model`` writes, without torch or the vLLM venv."""

from __future__ import annotations

from pathlib import Path

from scripts import tiny_llama_builder
from scripts.vllm_cpu_engine import MODEL_SPEC


def build_tiny_tokenizer(out_dir: Path) -> Path:
    if not (out_dir / "tokenizer.json").is_file():
        tiny_llama_builder.build_tokenizer(out_dir, MODEL_SPEC)
    return out_dir
