"""The scheduler's bookkeeping of managed engines: which replica's engine holds which place in the
fleet, at which URL, on which node.

Each managed entry has ``launch.replicas`` slots (``<name>``, or ``<name>-0`` …), present from the
start (``starting``, not eligible).  A replica whose engine answers ``/health`` reports it
(:meth:`ManagedFleet.register`) and keeps repeating the report (a heartbeat, so a scheduler that
restarted re-learns the fleet); the scheduler then scrapes it and it becomes eligible like any
engine.  When its process exits the replica says so (:meth:`ManagedFleet.down`): the slot is
ineligible at once.  Ray replaces the replica; the new one takes the slot over with its new URL,
keeping the slot's name (and its counts of requests still in flight), resetting its health.
"""

from __future__ import annotations

from collections import OrderedDict

from narwhal_serve.config import KVEventsEndpoint, EngineConfig, NarwhalConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.managed.slot import ManagedSlot, ReplicaReport, slot_names
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.health import Breaker


GONE_REMEMBERED = 4096  # replicas whose engine ended, remembered (a late heartbeat of one is ignored)


def initial_engines(cfg: NarwhalConfig) -> dict[str, EngineState]:
    """Every engine of the fleet in config order: URL engines (or the embedded simulated fleet),
    and one ``starting`` slot per replica of each managed engine."""
    out: dict[str, EngineState] = {}
    for e in cfg.resolved_engines():
        if e.launch is None:
            out[e.name] = EngineState(e)
            continue
        for k, name in enumerate(slot_names(e.name, e.launch.replicas)):
            # (no launch spec in the fleet's copies: views of the fleet travel to every ingress)
            st = EngineState(e.model_copy(update={"name": name, "launch": None}))
            st.managed = ManagedSlot(engine=e.name, index=k)
            out[name] = st
    return out


class ManagedFleet:
    def __init__(self, cfg: NarwhalConfig, engines: dict[str, EngineState]) -> None:
        self.specs: dict[str, EngineConfig] = {e.name: e for e in cfg.engines if e.launch is not None}
        self.engines = engines  # the scheduler's own dict: slots are added and removed in place
        self.cfg = cfg
        # replicas that said their engine ended: a heartbeat of one sent before it ended may come
        # after (Serve orders no two calls), and must not give it a slot again (none would leave)
        self.gone: OrderedDict[tuple[str, str], None] = OrderedDict()

    def _slots(self, engine: str) -> list[EngineState]:
        return sorted((e for e in self.engines.values() if e.managed is not None and e.managed.engine == engine),
                      key=lambda e: e.managed.index if e.managed is not None else 0)

    def register(self, rep: ReplicaReport, now: float) -> tuple[str, bool]:
        """Record ``rep``; (the slot's name, whether its engine changed and should be scraped now)."""
        spec = self.specs.get(rep.engine)
        if spec is None or spec.launch is None:
            raise ValueError(f"unknown managed engine {rep.engine!r}; managed engines are {sorted(self.specs)}")
        slots = self._slots(rep.engine)
        for st in slots:
            m = st.managed
            if m is not None and m.report is not None and m.report.replica == rep.replica:
                if m.state == "down":  # this replica's engine ended: it is on its way out
                    return st.cfg.name, False
                m.last_seen = now
                if m.report == rep:
                    return st.cfg.name, False
                return self._take(st, rep, now), True
        if (rep.engine, rep.replica) in self.gone:  # its engine ended, its slot taken over: no other
            return "", False
        free = next((st for st in slots if st.managed is not None and st.managed.free_for(rep.replica, now)), None)
        if free is None:
            # every slot is held by a live replica (Serve starts a replacement before the old one
            # stops, e.g. on redeploy): an extra slot until one of them goes down
            index = max((st.managed.index for st in slots if st.managed is not None), default=-1) + 1
            while f"{spec.name}-{index}" in self.engines:  # (a configured engine of that name: not it)
                index += 1
            base = spec.model_copy(update={"name": f"{spec.name}-{index}", "launch": None})
            free = EngineState(base).configure(self.cfg)
            free.managed = ManagedSlot(engine=spec.name, index=index)
            self.engines[base.name] = free
        return self._take(free, rep, now), True

    def _take(self, st: EngineState, rep: ReplicaReport, now: float) -> str:
        m = st.managed
        if m is None:
            raise ValueError(f"engine {st.cfg.name!r} is not managed")
        if m.report is None or m.report.replica != rep.replica:
            m.replicas_seen += 1
            # a new process: nothing known about it yet (in-flight counts and the TTFT model stay)
            # (its counters of faults and probes stay: a counter on /metrics never goes down)
            st.breaker = Breaker(faults_total=st.breaker.faults_total, probes_total=st.breaker.probes_total)
            st.prefix.clear()  # its cache starts empty (the blocks of requests placed there stay pending)
            st.load = EngineLoad()
            st.max_running_seen, st.queued_seen = 0, False
            st.inflight_at_scrape = 0
        kv = None if rep.kv_events is None else KVEventsEndpoint(endpoint=rep.kv_events[0], replay_endpoint=rep.kv_events[1])
        st.cfg = st.cfg.model_copy(update={"url": rep.url, "kv_events": kv})
        st.healthy, st.last_ok, st.failures = False, None, 0
        m.report, m.state, m.since, m.last_seen = rep, "up", now, now
        return st.cfg.name

    def down(self, engine: str, replica: str, reason: str, now: float) -> str | None:
        """The engine of ``replica`` ended: its slot takes no work (the slot's name, or None when
        the replica holds none — a newer one took it over)."""
        self.gone[(engine, replica)] = None
        while len(self.gone) > GONE_REMEMBERED:
            self.gone.popitem(last=False)
        for st in self._slots(engine):
            m = st.managed
            if m is not None and m.report is not None and m.report.replica == replica:
                if m.state != "down":
                    m.state, m.since, m.last_exit = "down", now, reason
                st.healthy = False
                self.leave_if_done(st)
                return st.cfg.name
        return None

    def leave_if_done(self, st: EngineState) -> bool:
        """An extra slot whose replica's engine ended leaves the fleet once nothing is in flight on
        it (at its ``down``, or when its last request ends): whether it left."""
        m = st.managed
        spec = self.specs[m.engine].launch if m is not None and m.engine in self.specs else None
        if m is None or spec is None or m.state != "down" or m.index < spec.replicas or st.inflight > 0:
            return False
        if self.engines.get(st.cfg.name) is st:
            del self.engines[st.cfg.name]
        return True
