"""Router cost at concurrency 1 against a running Narwhal (e.g. `make run`), printed as p50/p99.

    .venv/bin/python scripts/latency_c1.py [NARWHAL_URL] [ENGINE_URL]

1. streaming TTFT straight to ENGINE_URL vs through NARWHAL_URL, interleaved (first content delta);
2. non-streaming 200s and predictive 429s (X-TTFT-Target tiny) interleaved through NARWHAL_URL.
Defaults: http://127.0.0.1:8000 and the embedded fleet's unified engine http://127.0.0.1:8102.
"""

from __future__ import annotations

import json
import sys
import time

import httpx

MODEL = "narwhal-sim"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000


def ttft(c: httpx.Client, base: str) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    t = time.perf_counter()
    with c.stream("POST", base + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                if any((ch.get("delta") or {}).get("content") for ch in ev.get("choices", [])):
                    return time.perf_counter() - t
    raise RuntimeError("stream ended without content")


def main() -> None:
    nw = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
    engine = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8102"
    res: dict[str, list[float]] = {"direct": [], "narwhal": [], "200": [], "429": []}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(timeout=30) as c:
        for i in range(240):
            d, n = ttft(c, engine), ttft(c, nw)
            if i >= 40:  # warm-up
                res["direct"].append(d)
                res["narwhal"].append(n)
        for i in range(440):
            refuse = i % 2 == 1
            t = time.perf_counter()
            r = c.post(nw + "/v1/chat/completions", json=body,
                       headers={"X-TTFT-Target": "0.0001"} if refuse else {})
            dt = time.perf_counter() - t
            if r.status_code != (429 if refuse else 200):
                raise RuntimeError(f"unexpected {r.status_code}: {r.text[:200]}")
            if i >= 40:
                res["429" if refuse else "200"].append(dt)
    for k, label in (("direct", "TTFT direct to engine"), ("narwhal", "TTFT through Narwhal"),
                     ("200", "200, 1 token, non-streaming"), ("429", "429 prompt_exceeds_ttft_budget")):
        print(f"{label:32s} p50 {pct(res[k], 50):6.1f} ms   p99 {pct(res[k], 99):6.1f} ms   (n={len(res[k])})")
    print(f"{'added TTFT':32s} p50 {pct(res['narwhal'], 50) - pct(res['direct'], 50):6.1f} ms")


if __name__ == "__main__":
    main()
