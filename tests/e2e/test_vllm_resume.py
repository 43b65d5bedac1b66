"""Token-exact mid-stream failover against real vLLM-CPU engines (docs/contract.md, "Mid-stream resume"): four
greedy answers — chat (without an output limit: up to the context) and completions, streaming and
not — are placed on the victim while the other
engine is in maintenance (the victim held with SIGSTOP meanwhile, so that its answers outlast the
router's control steps on a loaded machine); it is then eligible again, the victim runs on in short slices, and is killed with SIGKILL mid-answer while stopped between two.  Every client still gets
one complete answer whose token IDs equal the surviving engine's own uninterrupted greedy run, the
router counts one resume per answer that was cut, and its request log names the engine that died."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ADMIN, REPORT, ResumeApp
from tests.e2e.helpers import body_for, parse_sse, path_of, wait_router_idle

pytestmark = pytest.mark.e2e

MAX_TOKENS = 440  # (max-model-len 512): about 2 s each, eight at once
KINDS = [("chat", True), ("chat", False), ("completion", True), ("completion", False)]


def greedy(route: str, stream: bool) -> dict[str, Any]:
    body = body_for(route, max_tokens=MAX_TOKENS, ignore_eos=True, return_token_ids=True, stream=stream)
    body.pop("seed", None)
    if route == "chat":  # no limit (the SDKs' default): up to the context, so the continuation asks
        body.pop("max_tokens")  # for the room it leaves (vLLM's completions endpoint refuses more)
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


async def request_log(tag: str, n: int, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """The request log lines (docs/operations.md, "Logs and traces") of the requests whose id starts with
    ``tag``, read from the Ray session's worker logs (the ingress writes them to its stdout)."""
    import ray._private.worker

    node = ray._private.worker._global_node
    assert node is not None
    logs = Path(node.get_logs_dir_path())
    end = time.monotonic() + timeout_s
    while True:
        found: dict[str, dict[str, Any]] = {}
        for f in logs.glob("worker-*.out"):
            for text in f.read_text(errors="replace").splitlines():
                if '"event":"request"' in text and tag in text:
                    line = json.loads(text[text.index("{"):])
                    found[line["request_id"]] = line
        if len(found) >= n or time.monotonic() > end:
            assert len(found) == n, sorted(found)
            return found
        await asyncio.sleep(0.2)


async def router_inflight(c: httpx.AsyncClient, url: str, engine: str) -> int:
    """The requests the router has placed on ``engine`` and not yet released (its /status)."""
    r = await c.get(url + "/status")
    r.raise_for_status()
    [e] = [e for e in r.json()["engines"] if e["name"] == engine]
    return int(e["inflight"])


def _outcome(task: asyncio.Task[httpx.Response]) -> str:
    """What a finished client task got: its exception, or its status and the start of its body."""
    if task.exception() is not None:
        return repr(task.exception())
    r = task.result()
    return f"HTTP {r.status_code}: {r.content[:300]!r}"


async def until(pred: Any, what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


async def test_an_engine_killed_mid_answer_is_replaced_token_exactly(resume_app: ResumeApp) -> None:
    app = resume_app
    async with httpx.AsyncClient(timeout=180) as c:
        # the surviving engine's own uninterrupted greedy answers: what every client must get
        ref: dict[tuple[str, bool], list[int]] = {}
        for route in ("chat", "completion"):
            r = await c.post(app.survivor.url + path_of(route), json=greedy(route, False))
            ref[(route, True)] = ref[(route, False)] = ids_and_usage(route, False, r)[0]
            assert len(ref[(route, True)]) == MAX_TOKENS if route == "completion" else len(ref[(route, True)]) > MAX_TOKENS
        for route in ("chat", "completion"):  # the ingress holds its admission lease before the burst
            r = await c.post(app.url + path_of(route), json=body_for(route, max_tokens=1))
            assert r.status_code == 200, r.text
        before = (await c.get(app.url + "/status")).json()

        tag = f"resume-{time.monotonic_ns()}"
        tasks: list[tuple[str, bool, asyncio.Task[httpx.Response]]] = []
        arrivals: dict[str, list[float]] = {}  # each streaming answer's events, as the client read them

        async def ask(route: str, stream: bool) -> httpx.Response:
            rid = f"{tag}-{route}-{'stream' if stream else 'json'}-{len(tasks)}"
            headers = {"X-Request-Id": rid}
            if not stream:
                return await c.post(app.url + path_of(route), json=greedy(route, stream), headers=headers)
            times = arrivals[rid] = []
            body = b""
            async with c.stream("POST", app.url + path_of(route), json=greedy(route, stream), headers=headers) as r:
                async for chunk in r.aiter_bytes():
                    body += chunk
                    times.extend([time.monotonic()] * chunk.count(b"data: "))
            return httpx.Response(r.status_code, content=body)

        # One request of each kind on the victim: the survivor takes no new work while they are
        # placed (maintenance), then it is eligible again and the victim dies under them. The victim
        # is stopped (SIGSTOP) while the router places them and while maintenance ends: the tiny
        # model writes its 440 tokens in under a second, faster than those steps take on a loaded
        # machine (CI: all four answers had ended before the kill). Stopped for well under the
        # scrape timeout (2 s), it stays eligible; the router's connections wait in its backlog.
        r = await c.post(app.url + "/admin/maintenance", json={"waves": ["b"]}, headers=ADMIN)
        assert r.status_code == 200, r.text
        os.killpg(app.victim.pid, signal.SIGSTOP)
        try:
            try:
                for route, stream in KINDS:
                    tasks.append((route, stream, asyncio.ensure_future(ask(route, stream))))

                async def all_placed() -> bool:
                    return await router_inflight(c, app.url, "victim") >= len(KINDS)

                await until(all_placed, "the router placed all four answers on the victim")
            finally:
                r = await c.request("DELETE", app.url + "/admin/maintenance", json={"waves": ["b"]}, headers=ADMIN)
                assert r.status_code == 200, r.text
        finally:
            os.killpg(app.victim.pid, signal.SIGCONT)

        # The victim runs on in short slices, stopped between them, until each streaming client has
        # read 24 of its tokens, and is killed while stopped: it cannot finish its answers between
        # the check and the kill (CI once found all four finished on the victim by the kill, the
        # clients still reading what the router had buffered ahead of them, its token counter read
        # while it ran on). Stopped, the router's count of its answers in flight is exact.
        async def mid_answer() -> bool:
            os.killpg(app.victim.pid, signal.SIGCONT)
            await asyncio.sleep(0.02)
            os.killpg(app.victim.pid, signal.SIGSTOP)
            await asyncio.sleep(0.05)  # (what it sent reaches the clients)
            return len(arrivals) == 2 and all(len(t) > 24 for t in arrivals.values())

        try:
            await until(mid_answer, "each streaming client 24 tokens into its answer")
            ended = [(route, stream, _outcome(t)) for route, stream, t in tasks if t.done()]
            assert not ended, f"answers ended before the kill: {ended}"
            on_victim = await router_inflight(c, app.url, "victim")
            assert on_victim == len(KINDS), f"{on_victim} of the answers still on the victim at the kill"
            killed_at = time.monotonic()
            os.killpg(app.victim.pid, signal.SIGKILL)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(app.victim.pid, signal.SIGCONT)  # (a failed check leaves it running, not stopped)
        for route, stream, task in tasks:
            ids, usage = ids_and_usage(route, stream, await task)
            assert ids == ref[(route, stream)], (route, stream, len(ids))
            assert usage["completion_tokens"] == len(ref[(route, stream)]) and usage["prompt_tokens"] > 0, usage
        took = time.monotonic() - killed_at
        await wait_router_idle(c, app.url)
        after = (await c.get(app.url + "/status")).json()
        metrics = (await c.get(app.url + "/metrics")).text
    old = {(r["reason"], r["outcome"]): r["count"] for r in before["resumes"]}
    cuts = {(r["reason"], r["outcome"]): r["count"] - old.get((r["reason"], r["outcome"]), 0)
            for r in after["resumes"] if r["count"] != old.get((r["reason"], r["outcome"]), 0)}
    # every answer is cut by the dying engine's reset, or, when the resets already seen opened
    # its circuit breaker, by the breaker before its own reset arrived (a race the kill decides);
    # either way all four are resumed and at least the first cut is a reset
    assert set(cuts) <= {("reset", "resumed"), ("breaker_open", "resumed")}, cuts
    assert sum(cuts.values()) == 4 and cuts.get(("reset", "resumed"), 0) >= 1, cuts
    assert after["counters"]["completed"] - before["counters"]["completed"] == len(tasks)
    assert after["counters"]["offered"] - before["counters"]["offered"] == len(tasks)
    # the request log says which answers were cut and where they ended: one of each kind
    lines = await request_log(tag, len(tasks))
    cut = sorted(rid.rsplit("-", 1)[0].split("-", 2)[2] for rid, line in lines.items() if line["resumed_from"])
    placed = {rid.split("-", 2)[2]: (line["admission"], line["resumed_from"] or line["engines"]) for rid, line in lines.items()}
    assert cut == ["chat-json", "chat-stream", "completion-json", "completion-stream"], placed
    assert all(line["outcome"] == "completed" for line in lines.values()), lines
    assert all(line["engines"] == ["vllm0"] for line in lines.values() if line["resumed_from"] == ["victim"]), lines
    gap, prefill, turn = (
        {k: float(v) for k, v in re.findall(rf"^narwhal_resume_{name}_seconds_(sum|count) (\S+)$", metrics, re.M)}
        for name in ("gap", "prefill", "turnaround"))
    assert gap["count"] == prefill["count"] == turn["count"] == 4
    pause, own, router = gap["sum"] / 4, prefill["sum"] / 4, turn["sum"] / 4
    line = (f"resume: the victim killed mid-answer, its 4 answers resumed on the survivor (no candidate at "
            f"admission), all token-exact; the last ended {took:.1f} s after the kill; the pause at the cut "
            f"{1000 * pause:.0f} ms on average = the dying engine noticed after {1000 * (pause - own - router):.0f} ms, "
            f"the router's turn-around {1000 * router:.1f} ms, the continuation's prefill {1000 * own:.0f} ms")
    print(line)
    REPORT.setdefault("extra", []).append(line)
    # what a streaming client waited from the kill to its next token: the dying engine noticed, the
    # router's turn-around and the continuation's prefill (the wait for the next token before the
    # kill is the engine's ordinary pace, not the failure's)
    waits = [min(t for t in times if t > killed_at) - killed_at for times in arrivals.values()]
    line = f"resume: streaming clients' wait from the kill to their next token: {', '.join(f'{1000 * w:.0f}' for w in waits)} ms"
    print(line)
    REPORT.setdefault("extra", []).append(line)
    # ... and the client's longest pause from the last read before the kill on (the victim's tokens
    # still in flight come first: the pause is the cut's), beside the victim's own intervals before it
    spans, usual = [], []
    for times in arrivals.values():
        reads = sorted(set(times))  # one time per read
        before_kill = [t for t in reads if t <= killed_at]
        usual += [b - a for a, b in zip(before_kill[1:], before_kill[2:])]  # (from the second read: the first may be the role)
        # (a loaded machine may not have delivered any of the victim's tokens by the kill: from the kill then)
        around = reads[len(before_kill) - 1:] if before_kill else [killed_at, *reads]
        spans.append(max(b - a for a, b in zip(around, around[1:])))
    usual.sort()
    line = (f"resume: streaming clients' pause at the cut {', '.join(f'{1000 * x:.0f}' for x in spans)} ms; "
            + (f"the victim's intervals before it p50 {1000 * usual[len(usual) // 2]:.0f} ms, max {1000 * usual[-1]:.0f} ms"
               if usual else "none of the victim's intervals read before it"))
    print(line)
    REPORT.setdefault("extra", []).append(line)
    assert router <= 0.05, router  # the router's turn-around at a cut: within 50 ms
