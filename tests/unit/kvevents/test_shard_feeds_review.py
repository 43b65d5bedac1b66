"""The sharded KV-event feeds (scheduler/kvfeeds.py ShardedKVFeeds), from a review: each test failed
before its fix, the comments say why.  Fake shard links only: no Ray, no ZMQ."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.kvevents.shard import PrefixDelta, Taken
from narwhal_serve.managed.slot import ReplicaReport
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.prefix import CREDIT_PRIOR
from narwhal_serve.scheduler import kvfeeds
from narwhal_serve.scheduler.kvfeeds import ShardedKVFeeds
from narwhal_serve.scheduler.service import SchedulerService


class FakeLink:
    """A shard: which engines it follows under which generation; calls can be made to fail."""

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation
        self.feeds: dict[str, int] = {}
        self.fail: set[str] = set()
        self.queued: list[Taken] = []
        self.failed: dict[str, int] = {"follow": 0, "drop": 0, "take": 0}

    def _call(self, op: str) -> None:
        if op in self.fail:
            self.failed[op] += 1
            raise ConnectionError(f"{op}: shard unreachable")

    async def follow(self, engine: str, gen: int, endpoint: str, replay_endpoint: str | None, topic: str) -> str:
        self._call("follow")
        self.feeds[engine] = gen
        return self.incarnation

    async def drop(self, engine: str) -> str:
        self._call("drop")
        self.feeds.pop(engine, None)
        return self.incarnation

    async def take(self, wait_s: float) -> Taken:
        self._call("take")
        await asyncio.sleep(0.005)
        if self.queued:
            return self.queued.pop(0)
        return Taken(self.incarnation, {}, views={n: {"state": "live"} for n in self.feeds})


def engines(*names: str) -> tuple[NarwhalConfig, dict[str, EngineState]]:
    cfg = NarwhalConfig.model_validate({"engines": [
        {"name": n, "url": f"http://127.0.0.1:{k + 1}", "kv_events": {"endpoint": f"tcp://127.0.0.1:{k + 100}"}}
        for k, n in enumerate(names)]})
    return cfg, {e.name: EngineState(e).configure(cfg) for e in cfg.engines}


async def until(pred: Callable[[], bool], timeout: float = 2.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


async def test_a_failed_drop_leaves_the_engine_followed_by_two_shards() -> None:
    # kvfeeds.py _send (l. 225-232) / _seen (l. 206-215): a failed "drop" only marks the shard lost;
    # when it answers again only the engines still assigned to it are followed again, so the drop is
    # never retried.  The shard keeps subscribing to the engine for good (a leak), and when the engine
    # was restarted onto another shard it is followed by two shards at once (the stale shard's views
    # also overwrite the engine's /status `shard`, taken l. 292-295).
    cfg, es = engines("a", "b", "c")
    links = [FakeLink("s0"), FakeLink("s1")]
    feeds = ShardedKVFeeds(cfg.placement, links)
    feeds.start(es.values())  # a → 0, b → 1, c → 0
    assert await until(lambda: links[0].feeds.keys() == {"a", "c"} and links[1].feeds.keys() == {"b"})
    feeds.drop("b")  # deregistered: load [2, 0]
    links[0].fail = {"drop"}
    feeds.restart(es["a"])  # a new process: dropped from shard 0 (fails), followed on shard 1
    assert feeds.followed["a"][0] == 1
    assert await until(lambda: links[1].feeds.keys() == {"a"})
    assert await until(lambda: links[0].failed["drop"] >= 1)
    links[0].fail = set()
    await asyncio.sleep(0.1)  # shard 0 answered takes since: its engines (c) were followed again
    try:
        assert "a" not in links[0].feeds, "shard 0 still follows an engine the scheduler moved to shard 1"
    finally:
        await feeds.stop()


async def test_a_shard_surviving_a_scheduler_restart_credits_its_stale_feeds() -> None:
    # kvfeeds.py taken (l. 281-284) checks only the generation, not that the delta comes from the shard
    # following the engine; _seen (l. 210) accepts a shard's first answer as is.  Generations restart
    # at 1 with each scheduler process (itertools.count(1)), while the KVEventShard deployments survive
    # a scheduler replica's restart with the feeds the previous scheduler gave them.  Here shard 0 still
    # follows "b" under generation 2 (the old scheduler's); the new scheduler follows "b" on shard 1 under
    # generation 2 as well, and shard 0's changes for "b" are credited to it (and shard 0 is never told
    # to drop "b").
    # (Generations are now unique across scheduler processes; the delta below carries b's very
    # generation anyway, to show a shard's changes count only for the engines it follows.)
    cfg, es = engines("a", "b")
    links = [FakeLink("s0"), FakeLink("s1")]
    feeds = ShardedKVFeeds(cfg.placement, links)
    feeds.start(es.values())  # a → shard 0, b → shard 1
    assert feeds.followed["b"][0] == 1
    gen_b = feeds.followed["b"][1]
    links[0].feeds["b"] = gen_b  # left over from the previous scheduler process
    links[0].queued = [Taken("s0", {"b": PrefixDelta(gen_b, added=(99,))})]
    assert await until(lambda: not links[0].queued)
    await asyncio.sleep(0.05)
    try:
        assert 99 not in set(es["b"].prefix.held()), "a block from a shard that does not follow b was credited"
        assert "b" not in links[0].feeds, "shard 0 keeps following b for the previous scheduler"
    finally:
        await feeds.stop()


async def test_pending_blocks_stay_pending_while_the_shards_takes_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    # kvfeeds.py _take (l. 238-251): blocks waiting to leave pending (unpend, UNPEND_GRACE_S) are only
    # settled after a successful take.  While the shard's takes fail, a done request's blocks stay
    # pending (credited to the engine) for as long as the outage lasts, not "for 1 s at most"
    # (docs/operations.md, "KV-event shards").
    monkeypatch.setattr(kvfeeds, "RESTART_S", 0.01)
    t = [100.0]
    cfg, es = engines("a")
    link = FakeLink("s0")
    feeds = ShardedKVFeeds(cfg.placement, [link], clock=lambda: t[0])
    feeds.start(es.values())
    assert await until(lambda: "a" in link.feeds)
    link.fail = {"take"}
    assert await until(lambda: link.failed["take"] >= 1)  # the shard is unreachable now
    e = es["a"]
    e.prefix.pend((11, 12))  # a request placed
    assert feeds.unpend(e, (11, 12))  # its prefill done; the engine's events have not named them yet
    t[0] += kvfeeds.UNPEND_GRACE_S + 5
    await asyncio.sleep(0.2)
    try:
        assert e.prefix.pending == 0, "a done request's blocks stay pending past the grace while takes fail"
    finally:
        await feeds.stop()


async def test_a_managed_extra_slot_that_leaves_stays_followed() -> None:
    # managed.py down (l. 103) deletes an extra slot from the scheduler's engines, and admin.py
    # managed_down (l. 64-66) never tells kv_events: the gone engine stays in ShardedKVFeeds.followed
    # (its shard's load, its EngineState) and its shard keeps subscribing to the dead engine's sockets.
    cfg = NarwhalConfig.model_validate({"engines": [
        {"name": "m", "role": "unified", "launch": {"kind": "sim", "replicas": 2}}]})
    link = FakeLink("s0")
    svc = SchedulerService(cfg, kv_shards=[link])
    svc._client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, text="")))
    svc._monitor = asyncio.get_running_loop().create_future()  # running (no monitoring loop needed here)
    svc.kv_events.start(svc.engines.values())

    def report(replica: str, port: int) -> ReplicaReport:
        return ReplicaReport(engine="m", replica=replica, url=f"http://10.0.0.1:{port}", node_id="n",
                             node_ip="10.0.0.1", accelerator_ids=("0",), pid=port, log="/tmp/x.log", ready_s=1.0,
                             kv_events=(f"tcp://10.0.0.1:{port + 1000}", f"tcp://10.0.0.1:{port + 2000}"))

    try:
        assert svc.register_managed(report("r1", 8001)) == "m-0"
        assert svc.register_managed(report("r2", 8002)) == "m-1"
        assert svc.register_managed(report("r3", 8003)) == "m-2"  # an extra slot (a redeploy's overlap)
        assert await until(lambda: link.feeds.keys() == {"m-0", "m-1", "m-2"})
        svc.managed_down("m", "r3", "stopped with its replica")
        assert "m-2" not in svc.engines  # the extra slot left with its replica
        await asyncio.sleep(0.1)
        assert "m-2" not in svc.kv_events.followed, "a gone engine is still followed"  # type: ignore[union-attr]
        assert "m-2" not in link.feeds
    finally:
        svc._monitor.cancel()
        await svc.kv_events.stop()
        for task in list(svc._background):
            task.cancel()
        await svc._client.aclose()


async def test_a_restart_without_kv_events_leaves_the_learned_index_fully_credited() -> None:
    # kvfeeds.py _Feeds.restart (l. 97-100): a managed engine whose new replica publishes no events goes
    # back to the learned index (prefix_exact False) but keeps prefix_credit 1.0 set by _exact (l. 38):
    # its learned (expected, not known) prefixes are credited as certain hits instead of starting from
    # CREDIT_PRIOR like every other engine without events.
    cfg, es = engines("a")
    link = FakeLink("s0")
    feeds = ShardedKVFeeds(cfg.placement, [link])
    feeds.start(es.values())
    e = es["a"]
    assert e.prefix_exact and e.prefix_credit == 1.0
    e.cfg = e.cfg.model_copy(update={"kv_events": None})  # the new replica reports no sockets
    feeds.restart(e)
    try:
        assert not e.prefix_exact
        assert e.prefix_credit == CREDIT_PRIOR, "learned index credited as exact"
    finally:
        await feeds.stop()
