"""Engine health and /metrics scraping: one pass over every engine, concurrently; and the probe
that closes an open circuit breaker."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx

from narwhal_serve.engines.client import TRANSPORT_ERRORS
from narwhal_serve.engines.dialect import PATHS
from narwhal_serve.engines.metrics import parse_engine_metrics
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.protocol.estimate import estimate_tokens

log = logging.getLogger("narwhal.monitor")


async def scrape_one(client: httpx.AsyncClient, e: EngineState, now: float, timeout_s: float) -> None:
    if not e.cfg.url:  # a managed engine not running yet: known to be down (not a silent one)
        e.healthy = False
        e.last_answer = now
        return
    base = e.cfg.base_url
    asks: list[Coroutine[Any, Any, object]] = [client.get(base + "/health", timeout=timeout_s),
                                               client.get(base + "/metrics", timeout=timeout_s)]
    if e.context_asked is None or now - e.context_asked >= CONTEXT_REASK_S:  # each time it comes up, and now and then
        asks.append(_models(client, base, timeout_s))
    try:
        health, metrics, *models = await asyncio.gather(*asks)
    except (httpx.HTTPError, OSError) as exc:
        e.healthy = False
        e.failures += 1
        e.context_asked = None  # (it may come back with another; the last one said is kept meanwhile)
        if not isinstance(exc, httpx.TimeoutException):  # refused or reset: a definite "down"
            e.last_answer = now
        return
    assert isinstance(health, httpx.Response) and isinstance(metrics, httpx.Response)
    # A plain OpenAI-compatible server (the openai dialect) may have no /health or /metrics route
    # (llama.cpp without --metrics, a hosted API): a 404/405 there is an answer — up, its load not
    # published (the router's own in-flight counts stand alone)
    plain = e.cfg.dialect == "openai"
    healthy = health.status_code == 200 or plain and health.status_code in NO_ROUTE
    text = metrics.text if metrics.status_code == 200 else "" if plain and metrics.status_code in NO_ROUTE else None
    scraped(e, now, healthy, text)
    if not e.healthy:
        e.context_asked = None
    elif models and models[0] is not None:
        e.context, e.context_asked = context_of(models[0]), now


NO_ROUTE = (404, 405)  # an engine's answer for a route it does not have

# An engine's context is asked for again this often while it stays up: one restarted behind the same
# address (a rolling restart behind a Service) may not have been seen down
CONTEXT_REASK_S = 60.0


async def _models(client: httpx.AsyncClient, base: str, timeout_s: float) -> object:
    """The engine's ``/v1/models`` answer: ``{}`` where it has no such route (404, 405: a plain
    server); None where it did not answer properly (an error, a 5xx, not JSON): asked again at the
    next scrape, and not a reason to call the engine down."""
    try:
        resp = await client.get(base + "/v1/models", timeout=timeout_s)
        if resp.status_code in NO_ROUTE:
            return {}
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, OSError, ValueError):
        return None


def context_of(models: object) -> int:
    """An engine's context length from its ``/v1/models`` answer: the ``max_model_len`` vLLM and
    SGLang put on each model card (the longest, where it serves several: LoRA adapters carry the
    base model's); 0 where it says none (a plain OpenAI server)."""
    cards = models.get("data") if isinstance(models, dict) else None
    lens = [c.get("max_model_len") for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
    return max((n for n in lens if isinstance(n, int) and not isinstance(n, bool) and n > 0), default=0)


def scraped(e: EngineState, now: float, healthy: bool, metrics: str | None) -> None:
    """An engine answered its scrape: ``/health`` (healthy or not) and ``/metrics`` (None: not 200)."""
    e.last_answer = now
    e.healthy = healthy
    if e.healthy and metrics is not None:
        e.load = parse_engine_metrics(metrics)
        e.inflight_at_scrape = e.inflight
        e.max_running_seen = max(e.max_running_seen, int(e.load.running))
        e.queued_seen = e.queued_seen or e.load.waiting > 0
        e.last_ok = now
        e.failures = 0
    else:
        e.failures += 1


async def scrape_all(
    client: httpx.AsyncClient, engines: list[EngineState], now: float, timeout_s: float
) -> None:
    await asyncio.gather(*(_scrape_apart(client, e, now, timeout_s) for e in engines))


async def _scrape_apart(client: httpx.AsyncClient, e: EngineState, now: float, timeout_s: float) -> None:
    """One engine's scrape, whatever its answers hold: one the router cannot read (a fault in the
    reading) is that engine's failed scrape — it answered, unusably: down — never the whole pass's
    (that stalled the monitoring of every engine, and the router went monitoring-degraded)."""
    try:
        await scrape_one(client, e, now, timeout_s)
    except Exception:
        log.exception("scrape of engine %s failed in the router: counted down", e.cfg.name)
        # answered, unusably: down (as scraped() books a down answer, not through it: the fault
        # may be in it)
        e.healthy = False
        e.failures += 1
        e.last_answer = now


async def probe_one(client: httpx.AsyncClient, e: EngineState, model: str, timeout_s: float) -> tuple[bool, str]:
    """One small real request (a one-token completion; a one-token chat for a plain OpenAI server
    that serves no text completions): does the engine answer it properly?

    For a vLLM engine the answer must carry one valid token ID (a probe whose ID list is bad
    does not count as good, as for any other measurement)."""
    body: dict[str, object] = {"model": model, "prompt": "ping", "max_tokens": 1, "stream": False}
    token_ids = e.cfg.dialect == "vllm"
    if token_ids:
        body["return_token_ids"] = True
    headers = {"X-Request-Id": f"narwhal-probe-{e.cfg.name}"}
    try:
        resp = await client.post(e.cfg.base_url + PATHS["completion"], json=body, timeout=timeout_s, headers=headers)
        if resp.status_code in (400, *NO_ROUTE) and e.cfg.dialect == "openai":
            # a plain server of a chat model may serve no text completions (OpenAI answers 404 "This
            # is a chat model..."): a one-token chat then
            chat = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1, "stream": False}
            resp = await client.post(e.cfg.base_url + PATHS["chat"], json=chat, timeout=timeout_s, headers=headers)
    except (*TRANSPORT_ERRORS, OSError) as exc:
        return False, f"probe failed: {type(exc).__name__}"
    if resp.status_code != 200:
        return False, f"probe answered HTTP {resp.status_code}"
    try:
        choices = resp.json().get("choices")
        choice = choices[0]
        ids = choice.get("token_ids") if token_ids else [0]
    except (ValueError, AttributeError, TypeError, IndexError, KeyError):
        return False, "probe answer is not a completion"
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in ids):
        return False, "probe answer has no valid token IDs"
    return True, ""


@dataclass(frozen=True)
class Profile:
    """One profiling request's measurements (``ok`` False: ``why`` says what was wrong)."""

    ok: bool
    why: str = ""
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float | None = None  # None: fewer than two tokens


_PROFILE_TEXT = "Narwhal profiles this engine's prefill and decode speed with a prompt of known size. "


async def profile_one(client: httpx.AsyncClient, e: EngineState, model: str, prompt_chars: int, max_tokens: int,
                      timeout_s: float, clock: Callable[[], float]) -> Profile:
    """A small streamed completion of a known prompt size: its TTFT and TPOT.  For a vLLM engine
    every token must come with a valid token ID, and the count of IDs is the count of tokens (a
    measurement whose ID list is bad is discarded)."""
    prompt = (_PROFILE_TEXT * (prompt_chars // len(_PROFILE_TEXT) + 1))[:prompt_chars]
    body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                               "ignore_eos": True, "stream_options": {"include_usage": True}}
    ids_expected = e.cfg.dialect == "vllm"
    if ids_expected:
        body["return_token_ids"] = True
    if e.cfg.dialect == "openai":
        body.pop("ignore_eos")
    start = clock()
    first: float | None = None
    last = start
    tokens = 0
    prompt_tokens = estimate_tokens(prompt_chars)  # until the engine's usage says
    try:
        async with client.stream("POST", e.cfg.base_url + PATHS["completion"], json=body, timeout=timeout_s,
                                 headers={"X-Request-Id": f"narwhal-profile-{e.cfg.name}"}) as resp:
            if resp.status_code != 200:
                return Profile(False, f"profile answered HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                    prompt_tokens = usage["prompt_tokens"]
                for choice in chunk.get("choices") or ():
                    if ids_expected:
                        ids = choice.get("token_ids")
                        if not isinstance(ids, list) or not all(
                                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                            return Profile(False, "profile answer has no valid token IDs")
                        n = len(ids)
                    else:
                        n = 1 if choice.get("text") else 0
                    if n:
                        now = clock()
                        first = now if first is None else first
                        last = now
                        tokens += n
    except (*TRANSPORT_ERRORS, OSError, ValueError, AttributeError, TypeError) as exc:
        return Profile(False, f"profile failed: {type(exc).__name__}")
    if first is None:
        return Profile(False, "profile produced no token")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Profile(True, "", prompt_tokens, first - start, tpot)
