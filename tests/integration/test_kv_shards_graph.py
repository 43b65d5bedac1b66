"""KV-event shards through the Ray graph: the session's main app follows its engines' KV events
through two shard deployments (``placement.kv_event_shards: 2``), not in the scheduler's replica."""

from __future__ import annotations

from typing import Any

import httpx

from tests.integration.conftest import MODEL, Graph
from tests.support.graph import wait_status


def _stored(snap: dict[str, Any]) -> dict[str, int]:
    return {e["name"]: (e.get("kv_events") or {}).get("stored", 0) for e in snap["engines"]}


async def test_engines_kv_events_are_followed_by_two_shard_deployments(graph: Graph) -> None:
    snap = await wait_status(graph.url, lambda s: all((e.get("kv_events") or {}).get("state") == "subscribed"
                                                      for e in s["engines"]), "every engine followed by a shard")
    shards = [e["kv_events"]["shard"] for e in snap["engines"]]
    assert sorted(shards) == [0, 0, 1] or sorted(shards) == [0, 1, 1]  # both shards used
    assert all(e["prefix_source"] == "kv_events" and e["prefix_credit"] == 1.0 for e in snap["engines"])
    before = _stored(snap)
    prompt = "kv shard " * 300  # a prompt of many KV blocks, new to every engine
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text

    def grew(s: dict[str, Any]) -> bool:
        after = _stored(s)
        return any(after[n] >= before.get(n, 0) + 8 and e["prefix_index_blocks"] > 0
                   for n, e in ((e["name"], e) for e in s["engines"]))

    # the shard applied the engine's events; the scheduler holds the blocks they name
    await wait_status(graph.url, grew, "an engine's events applied by its shard and its blocks held", timeout=10)
