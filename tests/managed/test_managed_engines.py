"""Managed engines on a multi-node cluster (one machine): each lands on the node its resources ask
for and /status says so; managed and URL engines serve side by side; an engine process killed is
ineligible at once, requests go elsewhere, Ray restarts it and it rejoins without operator action."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.managed.conftest import HEALTH_CHECK_PERIOD_S, MODEL, NOTES, Fleet, wait_for

pytestmark = pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")


def chat(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello narwhal"}], "max_tokens": max_tokens,
            **extra}


def served(url: str) -> int:
    return int(httpx.get(url + "/sim/stats", timeout=5).json()["total_requests"])


def proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def test_each_engine_runs_on_the_node_its_resources_ask_for(fleet: Fleet) -> None:
    engines = fleet.engines()
    za, zb, tp = (engines[n]["placement"] for n in ("za", "zb", "tp"))
    assert za["node_id"] == fleet.nodes["zone_a"] and zb["node_id"] == fleet.nodes["zone_b"]
    assert tp["node_id"] == fleet.nodes["gpu_node"]
    assert len({za["node_id"], zb["node_id"], tp["node_id"], fleet.nodes["head"]}) == 4
    for name in ("za", "zb", "tp"):
        e = engines[name]
        assert e["managed"] is True and e["eligible"] and e["placement"]["state"] == "up"
        assert e["url"].startswith(f"http://{e['placement']['node_ip']}:")
        assert Path(e["placement"]["log"]).exists() and e["placement"]["ready_s"] > 0
    assert engines["url0"]["managed"] is False and engines["url0"]["placement"] is None
    assert engines["url0"]["url"] == fleet.url_engine
    # tensor parallelism 2 over the GPU node's two GPUs: one bundle each, both visible to the engine
    assert sorted(tp["accelerator_ids"]) == ["0", "1"] and za["accelerator_ids"] == []
    env = proc_env(tp["pid"])
    assert sorted(env["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]
    assert env["OMP_NUM_THREADS"] == "1"
    metrics = httpx.get(fleet.url + "/metrics", timeout=10).text
    assert (f'narwhal_engine_info{{engine="za",managed="true",state="up",node_id="{za["node_id"]}",'
            f'node_ip="{za["node_ip"]}",replica="{za["replica"]}"}} 1') in metrics
    assert 'narwhal_engine_info{engine="url0",managed="false"' in metrics
    NOTES.append("placement: " + ", ".join(f"{n} → {engines[n]['placement']['node_id'][:8]} "
                                           f"(ready in {engines[n]['placement']['ready_s']:.1f} s)"
                                           for n in ("za", "zb", "tp")))


def test_managed_and_url_engines_serve_side_by_side(fleet: Fleet) -> None:
    urls = {n: e["url"] for n, e in fleet.engines().items()}
    before = {n: served(u) for n, u in urls.items()}
    with httpx.Client(base_url=fleet.url, timeout=30) as c:
        for _ in range(16):
            r = c.post("/v1/chat/completions", json=chat(return_token_ids=True))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["message"]["content"] and choice["token_ids"]
    got = {n: served(u) - before[n] for n, u in urls.items()}
    assert all(n > 0 for n in got.values()), got  # every engine, managed or not, took requests


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """'ok', or the error code of the error event a cut stream ended with."""
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return f"http_{r.status_code}"
        events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]  # never a silent truncation
    for ev in events[:-1]:
        err = json.loads(ev).get("error")
        if err is not None:
            assert err["code"] and err["message"], err
            return str(err["code"])
    return "ok"


async def _plain(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    r = await client.post("/v1/chat/completions", json=body)
    return "ok" if r.status_code == 200 else f"http_{r.status_code}"


async def test_a_killed_engine_is_restarted_by_ray_and_rejoins(fleet: Fleet) -> None:
    za = fleet.engines()["za"]
    old = za["placement"]
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
        # in flight when the process dies: 3 s streams and 3 s non-streaming requests on every engine
        long = chat(max_tokens=100)
        inflight = [asyncio.ensure_future(_stream(client, long)) for _ in range(8)]
        inflight += [asyncio.ensure_future(_plain(client, long)) for _ in range(8)]
        await asyncio.sleep(1.0)
        t_kill = time.monotonic()
        os.kill(old["pid"], signal.SIGKILL)

        # ineligible at once (the replica tells the scheduler), new requests go elsewhere
        def down() -> dict[str, Any] | None:
            e = fleet.engines()["za"]
            return e if not e["eligible"] else None

        gone = await asyncio.to_thread(wait_for, down, 10, "za ineligible after its process was killed", 0.05)
        t_down = time.monotonic() - t_kill
        assert gone["placement"]["state"] == "down" and "SIGKILL" in gone["placement"]["last_exit"]
        outage: Counter[str] = Counter()
        rejoined: dict[str, Any] | None = None
        while time.monotonic() - t_kill < 90:
            outage[await _plain(client, chat())] += 1
            e = (await client.get("/status")).json()["engines"]
            now = next(x for x in e if x["name"] == "za")
            if now["eligible"] and now["placement"]["pid"] != old["pid"]:
                rejoined = now
                break
            await asyncio.sleep(0.1)
        t_rejoin = time.monotonic() - t_kill
        results = Counter(await asyncio.gather(*inflight))

    assert rejoined is not None, "za did not rejoin within 90 s"
    p = rejoined["placement"]
    assert p["replica"] != old["replica"] and p["restarts"] == 1 and p["node_id"] == fleet.nodes["zone_a"]
    assert set(outage) == {"ok"}, outage  # while it was gone, every new request was served elsewhere
    # in flight on it: non-streaming requests (no headers sent yet) were retried on another engine;
    # streams past their headers ended with an error event and [DONE]
    assert results["ok"] + results["bad_engine_response"] == len(inflight), results
    n_plain_failed = sum(1 for t in inflight[8:] if t.result() != "ok")
    assert n_plain_failed == 0, [t.result() for t in inflight[8:]]
    # back in rotation: it takes requests again
    before = served(rejoined["url"])
    with httpx.Client(base_url=fleet.url, timeout=30) as c:
        for _ in range(12):
            assert c.post("/v1/chat/completions", json=chat()).status_code == 200
    assert served(rejoined["url"]) > before
    line = (f"kill → ineligible {t_down:.2f} s; kill → rejoined {t_rejoin:.1f} s (health check every "
            f"{HEALTH_CHECK_PERIOD_S:g} s, new engine ready in {p['ready_s']:.1f} s); during the outage "
            f"{sum(outage.values())} new requests, all served elsewhere; in flight at the kill: "
            f"{dict(results)} (streams cut on za end with an error event)")
    NOTES.append(line)
    print(line)


def test_an_engine_that_cannot_start_fails_the_deploy_with_its_log(fleet: Fleet) -> None:
    """What `serve run` shows when an engine never becomes healthy: the engine's exit and log tail."""
    from ray import serve

    from deployments.app import build_app

    bad = {"name": "bad", "role": "unified", "launch": {
        "kind": "command", "resources": {"num_cpus": 0},
        "command": ["{python}", "-c", "import sys; print('cannot load model /models/missing'); sys.exit(2)"]}}
    app = build_app({"model": MODEL, "engines": [bad],
                     "deployment": {"ingress_max_replicas": 1, "assembler_max_replicas": 1}})
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="Engine-bad"):
            serve.run(app, name="broken", route_prefix="/broken")
        # the deployment's status (what `serve status` and `serve run` print) carries the reason
        msg = serve.status().applications["broken"].deployments["Engine-bad"].message
    finally:
        serve.delete("broken")
    assert "exited with status 2 before its /health answered" in msg, msg[-2000:]
    assert "cannot load model /models/missing" in msg, msg[-2000:]
    NOTES.append(f"a failing engine fails its deploy in {time.monotonic() - t0:.0f} s, naming its exit and log tail")
