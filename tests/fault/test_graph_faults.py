"""Ray Serve replicas dying under load, on the ``solo`` application: an assembler replica killed
mid-stream, the scheduler replica killed and restarted by Serve. Streams end explicitly, later
requests succeed within bounded time, and no permit is leaked."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.fault.conftest import App, Fleet
from tests.fault.helpers import (
    Streaming,
    assert_envelope,
    assert_error_end,
    assert_quiescent,
    delta,
    long_stream,
    post,
    sse_events,
)
from tests.support.graph import chat_body, status

RECOVERY_S = 60.0  # Serve notices the dead replica and starts another (a fresh Ray worker: seconds)


def replicas(app: str, deployment: str) -> list[str]:
    """Live replica actor names of one deployment (Serve's naming: SERVE_REPLICA::app#deployment#id)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill_replica(app: str, deployment: str) -> str:
    import ray

    names = replicas(app, deployment)
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


async def until_served(app: App, timeout: float = RECOVERY_S) -> int:
    """Send requests until one is answered 200; every other answer must be an explicit error in
    the envelope, in bounded time. The number of requests sent."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    n = 0
    while True:
        n += 1
        try:
            r = await post(app, chat_body(), timeout=15)
        except httpx.TransportError:  # (the connection itself may be refused or cut while Serve reroutes)
            r = None
        if r is not None and r.status_code == 200:
            return n
        if r is not None:
            assert r.status_code >= 500, r.text
            assert_envelope(r, r.status_code)
        assert loop.time() < end, f"no request served within {timeout:.0f} s of the replica's death"
        await asyncio.sleep(0.2)


async def test_assembler_replica_death_ends_in_flight_streams_with_an_error_event(fleet: Fleet) -> None:
    app = fleet.solo
    before = await status(app.url)
    streams = [Streaming(app, chat_body(stream=True, sim={"fault": "hang_mid_stream", "fault_after": 3}))
               for _ in range(2)]
    for s in streams:
        await s.first_data()
    t0 = time.monotonic()
    dead = await asyncio.to_thread(kill_replica, "solo", "Assembler")
    for s in streams:
        r = await s.end(timeout=20)
        err = assert_error_end(r)
        assert err["type"] in ("server_error", "upstream_error", "internal_error") or err["code"], err
        assert s.ended_at is not None
        assert s.ended_at - t0 < 10, s.ended_at - t0
    sent = await until_served(app)
    assert dead not in await asyncio.to_thread(replicas, "solo", "Assembler")
    snap = await assert_quiescent(app)  # the engine saw both streams' connections close: idle
    d = delta(before, snap)
    assert d["offered"] == 2 + sent and d["failed"] >= 2, d


async def test_scheduler_replica_restart_leaks_no_permit_and_serves_again(fleet: Fleet) -> None:
    app = fleet.solo
    stream = Streaming(app, long_stream(1500))  # ~3 s of tokens across the restart
    await stream.first_data()
    dead = await asyncio.to_thread(kill_replica, "solo", "Scheduler")
    r = await stream.end(timeout=30)  # the stream in flight ends (in full or with an error event)
    events = sse_events(r.text)
    assert events and events[-1] == "[DONE]", events[-3:]
    await until_served(app)
    assert dead not in await asyncio.to_thread(replicas, "solo", "Scheduler")
    # the new scheduler: every permit back, no lease holding one. (Its counters restarted: the
    # stream admitted before the restart may end in them without its arrival, so offered and the
    # terminal classes need not balance across the restart.)
    await assert_quiescent(app, exact=False)
    # and from here on, it accounts exactly
    before = await status(app.url)
    for stream_it in (False, True):
        assert (await post(app, chat_body(stream=stream_it))).status_code == 200
    snap = await assert_quiescent(app, exact=False)
    assert delta(before, snap) == {"offered": 2, "completed": 2}
