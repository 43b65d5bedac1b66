"""Token-exact mid-stream failover against real vLLM-CPU engines (README, "Engine failures"): eight
greedy answers — chat and completions, streaming and not, each kind twice — are spread over two
engines; the engine serving half of them is killed with SIGKILL mid-answer.  Every client still
gets one complete answer whose token IDs equal the surviving engine's own uninterrupted greedy run,
and the router counts one resume per answer that was cut."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ResumeApp
from tests.e2e.helpers import body_for, parse_sse, path_of, vllm_generated, vllm_load, wait_router_idle

pytestmark = pytest.mark.e2e

MAX_TOKENS = 320
KINDS = [("chat", True), ("chat", False), ("completion", True), ("completion", False)]


def greedy(route: str, stream: bool) -> dict[str, Any]:
    body = body_for(route, max_tokens=MAX_TOKENS, ignore_eos=True, return_token_ids=True, stream=stream)
    body.pop("seed", None)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def ids_and_usage(route: str, stream: bool, r: httpx.Response) -> tuple[list[int], dict[str, Any]]:
    assert r.status_code == 200, r.text[:500]
    if stream:
        events = parse_sse(r.content)  # ends with [DONE]
        assert not any("error" in e for e in events), [e for e in events if "error" in e]
        ids = [i for e in events for c in e.get("choices") or () for i in c.get("token_ids") or ()]
        [usage] = [e["usage"] for e in events if e.get("usage")]
        return ids, usage
    out = r.json()
    return list(out["choices"][0]["token_ids"]), out["usage"]


async def inflight(c: httpx.AsyncClient, url: str) -> int:
    return sum(e.get("inflight") or 0 for e in (await c.get(url + "/status")).json()["engines"])


async def until(pred: Any, what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)


async def test_an_engine_killed_mid_answer_is_replaced_token_exactly(resume_app: ResumeApp) -> None:
    app = resume_app
    async with httpx.AsyncClient(timeout=180) as c:
        # the surviving engine's own uninterrupted greedy answers: what every client must get
        ref: dict[tuple[str, bool], list[int]] = {}
        for route in ("chat", "completion"):
            r = await c.post(app.survivor.url + path_of(route), json=greedy(route, False))
            ref[(route, True)] = ref[(route, False)] = ids_and_usage(route, False, r)[0]
            assert len(ref[(route, True)]) == MAX_TOKENS
        before = (await c.get(app.url + "/status")).json()
        generated = await vllm_generated(c, app.victim.url)

        async def ask(route: str, stream: bool) -> httpx.Response:
            return await c.post(app.url + path_of(route), json=greedy(route, stream))

        # each kind twice in a row, each admitted before the next: least-loaded placement splits
        # every pair over the two engines, so every kind has one answer on the victim
        tasks: list[tuple[str, bool, asyncio.Task[httpx.Response]]] = []
        for route, stream in KINDS:
            for _ in range(2):
                tasks.append((route, stream, asyncio.ensure_future(ask(route, stream))))
                n = len(tasks)

                async def admitted(n: int = n) -> bool:
                    return await inflight(c, app.url) >= n

                await until(admitted, f"{n} requests admitted")
        # kill the victim once it is well into its four answers
        async def mid_answer() -> bool:
            load = await vllm_load(c, app.victim.url)
            return load.get("num_requests_running") == 4 and await vllm_generated(c, app.victim.url) - generated >= 4 * 24

        await until(mid_answer, "the victim running its four answers, 24 tokens each")
        killed_at = time.monotonic()
        os.killpg(app.victim.pid, signal.SIGKILL)
        for route, stream, task in tasks:
            ids, usage = ids_and_usage(route, stream, await task)
            assert ids == ref[(route, stream)], (route, stream, len(ids))
            assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] > 0, usage
        took = time.monotonic() - killed_at
        await wait_router_idle(c, app.url)
        after = (await c.get(app.url + "/status")).json()
    old = {(r["reason"], r["outcome"]): r["count"] for r in before["resumes"]}
    cuts = {(r["reason"], r["outcome"]): r["count"] - old.get((r["reason"], r["outcome"]), 0)
            for r in after["resumes"] if r["count"] != old.get((r["reason"], r["outcome"]), 0)}
    assert cuts == {("reset", "resumed"): 4}, cuts
    assert after["counters"]["completed"] - before["counters"]["completed"] == 8
    assert after["counters"]["offered"] - before["counters"]["offered"] == 8
    print(f"killed the victim mid-answer: 4 answers resumed on the survivor, all 8 token-exact; "
          f"the last answer ended {took:.1f} s after the kill")
