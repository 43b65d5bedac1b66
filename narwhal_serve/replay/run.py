"""One replay: a trace through the router's real admission on a virtual clock, against a fleet of
simulated engines (:mod:`.engine`).

Real, unchanged: the scheduler service (its monitoring loop scrapes every engine's ``/metrics``, as
rendered by the simulator, through an in-process transport; its queue, leases, reaping, learning
and drift), each virtual ingress replica's lease and reporter, the gateway's admission
(:func:`narwhal_serve.gateway.admit.admit`), and the prefix index fed by the engines' own KV
events.  Not replayed: HTTP, SSE relaying and token checks (the engine's tokens are the trace's
count), client disconnects and engine failures.  An admitted request's first token and end reach
the router as the relay would report them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from narwhal_serve.admission.core import Ask
from narwhal_serve.config import EngineConfig, KVEventsEndpoint, NarwhalConfig
from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.config.tenants import TenantSpec
from narwhal_serve.gateway.admit import Refused, admit
from narwhal_serve.gateway.tenancy import class_of
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.shard import KVShard, Taken
from narwhal_serve.kvevents.wire import Event, KVEventBatch
from narwhal_serve.protocol.outcomes import Outcome
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.stats import RelayStats
from narwhal_serve.replay.costs import Costs, deep_size
from narwhal_serve.replay.engine import ReplayEngine, ReplayJob
from narwhal_serve.replay.trace import Prompts, TraceRequest
from narwhal_serve.scheduler.api import SchedulerApi
from narwhal_serve.scheduler.kvfeeds import exact_index
from narwhal_serve.scheduler.monitor import scraped
from narwhal_serve.scheduler.service import SchedulerService
from narwhal_serve.sim.kvevents import KVEventSink
from narwhal_serve.sim.metrics import render_metrics

@dataclass
class Served:
    """One try of one trace request, as its client saw it (times in virtual seconds from the first
    arrival); a refused first try that is retried has a second ``Served`` with ``retry_of``."""

    idx: int
    sent: float
    prompt_tokens: int
    max_tokens: int
    status: int = 0  # 200 admitted, else the refusal's HTTP status
    ok: bool = False  # completed
    error_code: str | None = None
    retry_after: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    retry_of: int | None = None
    predicted_ttft: float | None = None
    engines: tuple[str, ...] = ()


START = 1_000_000.0  # the virtual clock's origin (clear of 0, which some state reads as "never")
WARMUP_S = 2.0  # before the first arrival: the scheduler's first scrapes and the leases' first grants


# the simulator's timing with room for long prompts: a KV cache of 512 k tokens, no context limit
REPLAY_ENGINE = SimEngineConfig(num_gpu_blocks=32_768, max_model_len=1 << 20)


@dataclass(frozen=True)
class FleetSpec:
    """Engines by role, all of one timing model (``engine``)."""

    prefill: int = 0
    decode: int = 0
    unified: int = 4
    engine: SimEngineConfig = field(default_factory=lambda: REPLAY_ENGINE)

    def engines(self) -> list[SimEngineConfig]:
        out = []
        for role, n in (("prefill", self.prefill), ("decode", self.decode), ("unified", self.unified)):
            out += [self.engine.model_copy(update={"name": f"{role}-{i}", "role": role}) for i in range(n)]
        return out

    @property
    def label(self) -> str:
        return ",".join(f"{r}={n}" for r, n in (("prefill", self.prefill), ("decode", self.decode),
                                                 ("unified", self.unified)) if n)


@dataclass
class ReplayOptions:
    ttft_s: float = 2.0
    tpot_s: float | None = None  # None: no TPOT target sent
    ingresses: int = 2
    retries: bool = True  # a refusal with Retry-After is retried once, after it (as the SDKs do)
    progress_s: float = 0.5  # how often a stream's token count reaches its reporter
    speed: float = 1.0  # arrival times divided by this
    # clients send max_tokens = the trace's output length (as vLLM's benchmark replays a trace, with
    # ignore_eos); False: no max_tokens (the router expects the output lengths it learned)
    max_tokens: bool = True
    # one-way time between the router and an engine (a request's way there, its stream's way back);
    # 0: the engines' time alone (docs/performance.md, "Capacity planning by replay")
    hop_s: float = 0.0


class _DirectKV(KVEventSink):
    """KV events straight into the index that follows the engine, the scheduler's or a shard's (no
    socket on a virtual clock)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, costs: Costs | None) -> None:
        self.loop = loop
        self.costs = costs
        self.index: KVEventIndex | None = None
        self.seq = itertools.count()
        self.apply: Any = None
        self.blocks = 0  # blocks stored or removed (what the index is told)

    def attach(self, index: KVEventIndex, part: str) -> None:
        self.index, self.seq = index, itertools.count()
        self.apply = index.apply if self.costs is None else self.costs.timed(part, index.apply)

    def publish(self, events: Sequence[Event]) -> None:
        if events and self.apply is not None:
            self.blocks += sum(len(getattr(e, "block_hashes", ())) for e in events)
            self.apply(next(self.seq), KVEventBatch(self.loop.time(), list(events)))


class _ReplayShard(KVShard):
    """A KV-event shard whose engines' events come from the replayed engines (``kvshard.events``)."""

    def __init__(self, router_block_tokens: int, sinks: dict[str, _DirectKV], max_blocks: int | None = None) -> None:
        super().__init__(router_block_tokens, max_blocks=max_blocks)
        self.sinks = sinks

    def _subscribe(self, feed: Any, engine: str, endpoint: str, replay_endpoint: str | None, topic: str) -> None:
        self.sinks[engine].attach(feed.index, "kvshard.events")


class _ShardLink:
    """The scheduler's link to a replayed shard: its changes carried across the hop (``*.hop``)."""

    def __init__(self, shard: KVShard, costs: Costs | None) -> None:
        self.shard, self.costs = shard, costs

    async def follow(self, engine: str, gen: int, endpoint: str, replay_endpoint: str | None, topic: str) -> str:
        return await self.shard.follow(engine, gen, endpoint, replay_endpoint, topic)

    async def drop(self, engine: str) -> str:
        return await self.shard.drop(engine)

    async def take(self, wait_s: float) -> Taken:
        taken = await self.shard.take(wait_s)
        return taken if self.costs is None else self.costs.carried(taken, "kvshard", "scheduler")


class _Scheduler(SchedulerService):
    """The scheduler, its engines scraped in-process: their ``/metrics`` text as the simulator
    renders it, read by the scheduler's own parser (:func:`narwhal_serve.scheduler.monitor.scraped`)."""

    replayed: dict[str, ReplayEngine]
    costs: Costs | None = None

    async def scrape_engines(self) -> None:
        now = self.clock()
        apply = scraped if self.costs is None else self.costs.timed("scheduler.scrape", scraped)
        for name, e in self.engines.items():
            sim = self.replayed[name]
            sim.sync()
            apply(e, now, True, render_metrics(sim))


def _url(name: str) -> str:
    return f"http://{name}.replay"


@dataclass
class Replay:
    cfg: NarwhalConfig
    fleet: FleetSpec
    opts: ReplayOptions
    results: list[Served] = field(default_factory=list)
    engines: dict[str, ReplayEngine] = field(default_factory=dict)
    wall_s: float = 0.0
    virtual_s: float = 0.0  # first arrival to last answer
    utilisation: dict[str, tuple[float, float]] = field(default_factory=dict)  # ReplayEngine.utilisation
    snapshot: dict[str, Any] = field(default_factory=dict)
    costs: Costs | None = None  # given: what each part of the router costs (:mod:`.costs`)
    kv_blocks: int = 0  # blocks the engines' KV events stored or removed
    memory_mb: dict[str, float] = field(default_factory=dict)  # with costs: what the router's state holds at the end (replay/costs.py)
    _left: int = 0
    _done: asyncio.Event | None = None
    _specs: dict[str, TenantSpec] = field(default_factory=dict)  # the configured tenants by name
    _streams: dict[str, tuple[ReplayJob, Reporter, ReplayEngine]] = field(default_factory=dict)

    def _handler(self, request: httpx.Request) -> httpx.Response:
        """What the scheduler asks an engine besides its scrapes (probes, profiles): not replayed."""
        return httpx.Response(503, text="not replayed")

    async def run(self, trace: Sequence[TraceRequest]) -> list[Served]:
        loop = asyncio.get_running_loop()
        self._specs = self.cfg.tenants.by_name() if self.cfg.tenants is not None else {}
        adm = self.cfg.admission
        unknown = sorted({r.klass for r in trace if r.klass and adm.class_rank(r.klass.strip().lower()) is None})
        if unknown:
            raise ValueError(f"trace classes {unknown} are not configured (admission.classes: "
                             f"{[c.name for c in adm.classes]})")
        sims = self.fleet.engines()
        pl = self.cfg.placement
        costs = self.costs
        sinks = {s.name: _DirectKV(loop, costs) for s in sims} if pl.prefix_aware else {}
        shards = [_ReplayShard(pl.prefix_block_tokens, sinks, pl.prefix_max_blocks)
                  for _ in range(pl.kv_event_shards if sinks else 0)]
        # with shards, every engine is followed by its KV events (as the simulator's are, over sockets)
        ends = KVEventsEndpoint(endpoint="inproc://replay") if shards else None
        engines = tuple(EngineConfig(name=s.name, url=_url(s.name), role=s.role, max_num_seqs=s.max_num_seqs,
                                     kv_events=ends) for s in sims)
        cfg = self.cfg.model_copy(update={"engines": engines})
        svc = _Scheduler(cfg, clock=loop.time, mono=loop.time, kv_shards=[_ShardLink(k, costs) for k in shards])
        svc.replayed = self.engines
        svc.costs = costs
        if costs is not None:
            svc.report = costs.timed("scheduler.report", svc.report)  # type: ignore[method-assign]
            svc.admit = costs.timed_async("scheduler.admit", svc.admit)  # type: ignore[method-assign,assignment]
            svc.reap = costs.timed("scheduler.periodic", svc.reap)  # type: ignore[method-assign]
            svc.start_probes = costs.timed("scheduler.periodic", svc.start_probes)  # type: ignore[method-assign]
            # (within scheduler.report: its reads of every engine, each FULL_VIEW_S and scrape pass)
            svc._read_all = costs.timed("scheduler.report.full_read", svc._read_all)  # type: ignore[method-assign]
        svc._client = httpx.AsyncClient(transport=httpx.MockTransport(self._handler))
        if shards and costs is not None:
            svc.kv_events.taken = costs.timed("scheduler.kv_events", svc.kv_events.taken)  # type: ignore[union-attr,method-assign]
        for s in sims:
            sink = sinks.get(s.name)
            if sink is not None and not shards:
                sink.attach(exact_index(svc.engines[s.name], cfg.placement, svc.touch), "scheduler.kv_events")
            self.engines[s.name] = ReplayEngine(s, loop, sink)
        api = SchedulerApi()
        api.svc = svc
        send = api.report if costs is None else costs.hop(api.report)
        watch: Callable[[str], Awaitable[bool]] | None = None
        if cfg.admission.lease_watch:
            watch = api.watch if costs is None else costs.hop(api.watch)  # (the call and its answer, as a report's)
        reporters = [Reporter(send, lease=AdmissionLease(f"ingress-{k}") if cfg.admission.ingress_leases else None,
                              linger_s=cfg.admission.report_linger_s, watch=watch,
                              clock=loop.time, mono=loop.time) for k in range(self.opts.ingresses)]
        for r in reporters:
            if costs is not None and r.lease is not None:
                r.lease.try_admit = costs.timed("ingress.decide", r.lease.try_admit)  # type: ignore[method-assign]
                r.lease.apply = costs.timed("ingress.grant", r.lease.apply)  # type: ignore[method-assign]
                r.lease.cut = costs.timed("ingress.cut", r.lease.cut)  # type: ignore[method-assign]
        prompts = Prompts(sims[0].kv_block_size if sims else 16, cfg.placement.prefix_block_tokens,
                          cfg.placement.prefix_max_blocks)
        svc.start()
        for r in reporters:
            r.start()
        self._done = asyncio.Event()
        self._left = len(trace)
        t0 = loop.time() + WARMUP_S
        first = trace[0].at_s if trace else 0.0
        wall = time.perf_counter()
        for i, req in enumerate(trace):
            loop.call_at(t0 + (req.at_s - first) / self.opts.speed, self._arrive, i, req, None, reporters, prompts,
                         svc, t0)
        ticker = loop.create_task(self._progress())
        with costs.watching_gc() if costs is not None else contextlib.nullcontext():
            if trace:
                await self._done.wait()
        self.wall_s = time.perf_counter() - wall
        self.virtual_s = loop.time() - t0
        self.utilisation = {name: e.utilisation(loop.time()) for name, e in self.engines.items()}
        self.kv_blocks = sum(k.blocks for k in sinks.values())
        if costs is not None:  # what the router holds at the end, caches warm (MB)
            lease = next((r.lease for r in reporters if r.lease is not None), None)
            self.memory_mb = {
                "scheduler KV-event index (all engines)": deep_size(*(k.index for k in sinks.values())) / 1e6,
                "one ingress lease's view": deep_size(lease.view) / 1e6 if lease is not None else 0.0,
            }
            if shards:  # the indexes are the shards'; the scheduler holds the prefix sets they keep
                self.memory_mb[f"{len(shards)} shards' KV-event index (all engines)"] = self.memory_mb.pop(
                    "scheduler KV-event index (all engines)")
                self.memory_mb["scheduler prefix sets (all engines)"] = deep_size(
                    *(e.prefix for e in svc.engines.values())) / 1e6
        ticker.cancel()
        for r in reporters:
            await r.flush()
            await r.stop()
        self.snapshot = svc.snapshot()  # the scheduler's /status at the end (counters, gauges, engines)
        await svc.stop()
        self.results.sort(key=lambda r: (r.sent, r.idx))
        return self.results

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.opts.progress_s)
            now = asyncio.get_running_loop().time()
            for ticket, (job, rep, engine) in self._streams.items():
                if job.done:
                    rep.progress(ticket, engine.tokens_of(job, now))

    def _arrive(self, i: int, req: TraceRequest, retry_of: Served | None, reporters: list[Reporter],
                prompts: Prompts, svc: SchedulerService, t0: float) -> None:
        asyncio.get_running_loop().create_task(self._request(i, req, retry_of, reporters, prompts, svc, t0))

    async def _request(self, i: int, req: TraceRequest, retry_of: Served | None, reporters: list[Reporter],
                       prompts: Prompts, svc: SchedulerService, t0: float) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        rep = reporters[(i + (retry_of is not None)) % len(reporters)]
        rep.start_once()
        rep.offered()
        prompt = prompts.of(req, i)
        res = Served(i, now - t0, req.input_tokens, req.output_tokens,
                            retry_of=None if retry_of is None else retry_of.idx)
        self.results.append(res)
        fixed = max(1, req.output_tokens) if self.opts.max_tokens else None  # (ignore_eos: exactly that)
        ask = Ask(req.input_tokens, self.opts.ttft_s, self.opts.tpot_s, "completion", fixed, prompt.router_hashes,
                  float(self.cfg.placement.prefix_block_tokens) if prompt.router_hashes else 0.0,
                  retry=retry_of is not None, reserves=self.opts.retries, tenant=req.tenant,
                  min_output_tokens=fixed or 0)
        ticket = f"r{i}/{'retry' if retry_of is not None else 'first'}"
        deadline = now + self.cfg.serving.request_timeout_s
        spec = self._specs.get(req.tenant or "")
        rank, within = class_of(self.cfg.admission, spec, req.klass or None)  # (as the gateway reads X-Priority)
        klass = self.cfg.admission.classes[rank].name
        ask = replace(ask, rank=rank, admit_within_s=within)
        got = await admit(rep, ticket, ask, deadline, now, now, svc.admit,
                          slots_counted=spec is not None and spec.max_concurrent is not None)
        if isinstance(got, Refused):
            if not got.counted:
                rep.outcome(got.outcome, got.error.code, req.tenant or None, klass)
            res.status, res.error_code, res.retry_after = got.error.status, got.error.code, got.error.retry_after
            res.e2e = loop.time() - now
            if retry_of is None and self.opts.retries and got.error.retry_after is not None:
                loop.call_later(got.error.retry_after, self._arrive, i, req, res, reporters, prompts, svc, t0)
            else:
                self._finished()
            return
        wait = loop.time() - now
        # its predicted TTFT counted as its TTFT is, from its send: the wait and the projection (as the gateway's)
        res.status, res.engines = 200, got.routes[0].engines
        res.predicted_ttft = None if got.predicted_s is None else wait + got.predicted_s
        rep.admission_wait(wait)
        self._serve(got.routes[0], ticket, prompt.ids, prompt.engine_hashes, req, res, rep, now, klass)

    def _serve(self, route: RouteChoice, ticket: str, ids: list[int], hashes: list[int], req: TraceRequest,
               res: Served, rep: Reporter, sent: float, klass: str) -> None:
        """``sent``: the client's send; the engine's request goes now (the models learn the TTFT
        from here, the client's counts its admission wait too: protocol/stats.py)."""
        first_at: list[float] = []
        ends: list[tuple[float, int]] = []  # an end that reached the hop before its first token got across
        loop, hop = asyncio.get_running_loop(), self.opts.hop_s
        asked = loop.time()

        def first(t: float) -> None:
            first_at.append(t)
            res.ttft = t - sent
            rep.first_token(ticket, route.engines)
            for at, tokens in ends:  # (after this one: one stream's messages keep their order)
                loop.call_at(at, end, at, tokens)

        def end(t: float, tokens: int) -> None:
            self._streams.pop(ticket, None)
            res.ok, res.e2e, res.output_tokens = True, t - sent, tokens
            stats = RelayStats("completion", route.engines, first_at[0] - asked, tokens, t - first_at[0], 1,
                               received_ttft_s=res.ttft)
            rep.ended(ticket, Outcome.COMPLETED, "", stats, req.tenant or None, klass)
            self._finished()

        def on_first(t: float) -> None:  # (reaches the router one hop after the engine made it)
            if hop:
                loop.call_at(t + hop, first, t + hop)
            else:
                first(t)

        def on_end(t: float, tokens: int) -> None:
            if not hop:
                end(t, tokens)
            elif first_at:
                loop.call_at(t + hop, end, t + hop, tokens)
            else:  # the first token is still crossing: timers due at the same instant run in any order
                ends.append((t + hop, tokens))

        def send(engine: ReplayEngine, job: ReplayJob, hops: int = 1) -> None:
            if hop:
                loop.call_later(hops * hop, engine.submit, job)
            else:
                engine.submit(job)

        decode = self.engines[route.decode.name]
        job = ReplayJob(ids, hashes, max(1, req.output_tokens), on_first, on_end)
        if route.prefill is None:
            send(decode, job)
        else:  # vLLM's two steps: the prefill leg (one token), then the decode leg with its KV
            def prefilled(t: float, tokens: int) -> None:
                job.skip_prefill = True
                send(decode, job, 2)  # its answer back to the router, then the decode leg out

            send(self.engines[route.prefill.name], ReplayJob(ids, hashes, 1, None, prefilled))
        self._streams[ticket] = (job, rep, decode)

    def _finished(self) -> None:
        self._left -= 1
        if self._left <= 0 and self._done is not None:
            self._done.set()
