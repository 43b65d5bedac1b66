"""Small helpers for the e2e suite: raw SSE reading, stream folding, seeded request bodies."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx

MODEL = "tiny"
CHAT_MESSAGES = [{"role": "user", "content": "Hello, who are you? Tell me about the narwhal."}]
PROMPT = "The quick brown fox jumps over the lazy dog"
# Engine-internal keys that must never reach a Narwhal client.
TRANSFER_KEYS = ("kv_transfer_params", "ec_transfer_params")


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 8, "temperature": 0, "seed": 7, **extra}


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "seed": 7, **extra}


def path_of(route: str) -> str:
    return "/v1/chat/completions" if route == "chat" else "/v1/completions"


def body_for(route: str, **extra: Any) -> dict[str, Any]:
    return chat_body(**extra) if route == "chat" else completion_body(**extra)


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body, in order; asserts it ends with ``data: [DONE]``."""
    events: list[bytes] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [ln[5:].lstrip(b" ") for ln in block.split(b"\n") if ln.startswith(b"data:")]
        if data:
            events.append(b"\n".join(data))
    assert events and events[-1] == b"[DONE]", f"stream does not end with [DONE]: {raw[-300:]!r}"
    return [json.loads(e) for e in events[:-1]]


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    r = await client.post(url, json=body, headers=headers or {})
    assert r.status_code == 200, f"{url}: HTTP {r.status_code}: {r.text[:500]}"
    return r


async def stream_events(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[httpx.Response, list[dict[str, Any]]]:
    r = await post(client, url, {**body, "stream": True}, headers)
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    return r, parse_sse(r.content)


def fold_stream(route: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold choice 0 of a stream: text, token IDs, logprobs, finish/stop reasons, prompt IDs, usage."""
    text: list[str] = []
    ids: list[int] = []
    saw_ids = False
    chat_lp: list[Any] = []
    text_lp: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    out: dict[str, Any] = {"finish_reason": None, "stop_reason": None, "prompt_token_ids": None, "usage": None}
    for ev in events:
        if ev.get("usage"):
            out["usage"] = ev["usage"]
        if route == "chat" and ev.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = ev["prompt_token_ids"]
        for ch in ev.get("choices") or []:
            assert ch["index"] == 0
            if route == "chat":
                delta = ch.get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                lp = ch.get("logprobs")
                if lp and lp.get("content"):
                    chat_lp.extend(lp["content"])
            else:
                text.append(ch.get("text") or "")
                if ch.get("prompt_token_ids") is not None:
                    out["prompt_token_ids"] = ch["prompt_token_ids"]
                lp = ch.get("logprobs")
                if lp:
                    for k in text_lp:
                        text_lp[k].extend(lp.get(k) or [])
            if ch.get("token_ids") is not None:
                saw_ids = True
                ids.extend(ch["token_ids"])
            if ch.get("finish_reason") is not None:
                out["finish_reason"] = ch["finish_reason"]
            if ch.get("stop_reason") is not None:
                out["stop_reason"] = ch["stop_reason"]
    out["text"] = "".join(text)
    out["token_ids"] = ids if saw_ids else None
    out["logprobs"] = ({"content": chat_lp} if chat_lp else None) if route == "chat" else (
        text_lp if text_lp["tokens"] else None)
    return out


def fold_json(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same view of a non-streaming response."""
    ch = body["choices"][0]
    lp = ch.get("logprobs")
    return {
        "text": ch["message"]["content"] if route == "chat" else ch["text"],
        "token_ids": ch.get("token_ids"),
        "logprobs": ({"content": lp["content"]} if lp else None) if route == "chat" else lp,
        "finish_reason": ch["finish_reason"],
        "stop_reason": ch.get("stop_reason"),
        "prompt_token_ids": body.get("prompt_token_ids") if route == "chat" else ch.get("prompt_token_ids"),
        "usage": body.get("usage"),
    }


def counts(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def find_keys(obj: Any, keys: tuple[str, ...], path: str = "", *, valued: bool = False) -> list[str]:
    """Paths at which any of ``keys`` occurs in a JSON value (``valued``: with a value other than null)."""
    found: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}" if path else k
            if k in keys and not (valued and v is None):
                found.append(p)
            found.extend(find_keys(v, keys, p, valued=valued))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found.extend(find_keys(v, keys, f"{path}.{i}", valued=valued))
    return found


def valued_keys(obj: Any, keys: tuple[str, ...]) -> list[str]:
    """Paths at which any of ``keys`` occurs with a value other than null."""
    return find_keys(obj, keys, valued=True)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


_GAUGE = re.compile(r'^(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc))\{[^}]*\} ([0-9.e+-]+)$', re.M)


async def vllm_load(c: httpx.AsyncClient, url: str) -> dict[str, float]:
    """A vLLM server's running and waiting requests and KV-cache usage, from its /metrics."""
    r = await c.get(url + "/metrics")
    r.raise_for_status()
    return {k.split(":", 1)[1]: float(v) for k, v in _GAUGE.findall(r.text)}


_GENERATED = re.compile(r'^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+-]+)$', re.M)


async def vllm_generated(c: httpx.AsyncClient, url: str) -> float:
    """The tokens a vLLM server has generated so far (its /metrics)."""
    r = await c.get(url + "/metrics")
    r.raise_for_status()
    return sum(float(v) for v in _GENERATED.findall(r.text))


async def wait_vllm_idle(c: httpx.AsyncClient, url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll until the server runs and queues nothing and holds no KV blocks (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        load = await vllm_load(c, url)
        if load.get("num_requests_running") == 0 and load.get("num_requests_waiting") == 0 \
                and load.get("kv_cache_usage_perc") == 0:
            return load
        if loop.time() > end:
            raise AssertionError(f"vLLM at {url} still busy {timeout_s} s after the client left: {load}")
        await asyncio.sleep(0.2)


async def leave_mid_stream(c: httpx.AsyncClient, url: str, body: dict[str, Any], events: int = 1) -> None:
    """Stream ``body`` through Narwhal, read ``events`` token events and leave (close the
    connection) while the engine still generates."""
    async with c.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= events:
                    break


async def wait_router_idle(c: httpx.AsyncClient, narwhal: str, timeout_s: float = 15.0) -> dict[str, Any]:
    """Poll Narwhal's /status until no request holds a permit or a retention slot (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        g = (await c.get(narwhal + "/status")).json()["gauges"]
        if g["retained"] == 0 and g["prefill_inflight"] == 0 and g["decode_inflight"] == 0 and g["queued"] == 0:
            return dict(g)
        if loop.time() > end:
            raise AssertionError(f"Narwhal still holds permits {timeout_s} s after the client left: {g}")
        await asyncio.sleep(0.1)
