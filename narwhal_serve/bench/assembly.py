"""``narwhal-bench assembly``: the per-token cost of the assembly and relay code on one long stream.

Feeds a synthetic chat stream shaped like vLLM 0.32's (one token per chunk, top-2 logprobs, token
IDs) through (a) the non-streaming path — token-ID check and fold, then the final response — and
(b) the streaming path — token-ID check, exposure rules, SSE serialization — and prints µs per token.
Pure CPU, no servers; prints a table and writes JSON.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from narwhal_serve.assembly.exposure import expose
from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.assembly.tokens import check_token_ids
from narwhal_serve.protocol.sse import sse_event

_ROLE: dict[str, Any] = {
    "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "m",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
    "prompt_token_ids": [3, 57, 804, 606], "prompt_text": None,
}


def _token(i: int) -> dict[str, Any]:
    lp = {"token": "ab", "logprob": -7.4, "bytes": [97, 98],
          "top_logprobs": [{"token": "ab", "logprob": -7.4, "bytes": [97, 98]}, {"token": "c", "logprob": -7.5, "bytes": [99]}]}
    return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": "ab"}, "logprobs": {"content": [lp]},
                         "finish_reason": None, "token_ids": [i % 2048]}]}


def stream(tokens: int) -> list[dict[str, Any]]:
    chunks = [copy.deepcopy(_ROLE)] + [_token(i) for i in range(tokens)]
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    return chunks


def measure(tokens: int = 20_000, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` µs per token for each path."""
    best_fold = best_relay = float("inf")
    for _ in range(repeats):
        chunks = stream(tokens)
        t0 = time.perf_counter()
        asm = Assembler("chat", return_token_ids=True)
        for c in chunks:
            check_token_ids(c, "chat")
            asm.feed(c)
        asm.result(prompt_tokens=4)
        best_fold = min(best_fold, time.perf_counter() - t0)
        chunks = stream(tokens)
        t0 = time.perf_counter()
        for c in chunks:
            check_token_ids(c, "chat")
            sse_event(expose(c, return_token_ids=False))
        best_relay = min(best_relay, time.perf_counter() - t0)
    return {"tokens": tokens, "fold_us_per_token": best_fold / tokens * 1e6,
            "relay_us_per_token": best_relay / tokens * 1e6}


def run(out_dir: Path, tokens: int) -> dict[str, float]:
    res = measure(tokens)
    print(f"assembly over {tokens} tokens (best of 3):")
    print(f"  non-streaming: check IDs + fold + result   {res['fold_us_per_token']:6.1f} µs/token")
    print(f"  streaming:     check IDs + expose + SSE    {res['relay_us_per_token']:6.1f} µs/token")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    return res
