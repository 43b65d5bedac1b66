"""Grants carry the engines changed since the lease's view, and the lease's view stays the
scheduler's: over random traffic, scrapes and engines leaving and rejoining, a lease synced by
deltas holds exactly the facts a whole grant would give, decides exactly as on a whole view, and
falls back to a whole view when a grant is lost.  Grants cross the Ray hop pickled: that is done
here too, and nothing a view derives for decisions goes with it."""

from __future__ import annotations

import math
import pickle
import random
from dataclasses import fields

from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.admission.facts import EngineFacts
from narwhal_serve.admission.view import FleetView
from narwhal_serve.admission.wire import LeaseGrant
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.scheduler.messages import Report
from narwhal_serve.scheduler.service import SchedulerService
from tests.support.scheduler import Clock

BIG = 10**6


def _service(engines: int) -> tuple[SchedulerService, Clock]:
    clock = Clock()
    specs = [{"name": f"e{i}", "url": f"http://127.0.0.1:{10000 + i}",
              "role": "unified" if i % 2 == 0 else ("prefill" if i % 4 == 1 else "decode")} for i in range(engines)]
    cfg = NarwhalConfig.model_validate({
        "serving": {"http_retention_limit": BIG},
        "admission": {"mode": "predictive", "queue_limit": BIG, "phase_concurrency": {"prefill": BIG, "decode": BIG}},
        "engines": specs,
    })
    svc = SchedulerService(cfg, clock=clock)
    for e in svc.engines.values():
        e.healthy, e.last_ok = True, clock.t
    svc.router.started = True
    return svc, clock


def _facts(view: FleetView) -> list[tuple[object, ...]]:
    """Every engine's facts as values."""
    out = []
    for e in view.current():
        row = tuple(getattr(e, f.name) for f in fields(EngineFacts) if f.name not in ("eligible_until", "prefix", "cfg"))
        out.append((e.cfg.name, e.eligible_until, frozenset(e.prefix), *row))  # (a view keeps the scheduler's times)
    return out


class Holder:
    def __init__(self, svc: SchedulerService, clock: Clock) -> None:
        self.svc, self.clock, self.lease = svc, clock, AdmissionLease("i1")
        self.grants: list[LeaseGrant] = []

    def sync(self, lose: bool = False) -> LeaseGrant:
        grant = self.svc.report(Report(lease=self.lease.cut(0.0)))
        assert grant is not None
        grant = pickle.loads(pickle.dumps(grant))  # as across the Ray hop
        self.grants.append(grant)
        if not lose:
            self.lease.apply(grant, self.clock() + 5.0, 0.0)  # the ingress's clock is 5 s ahead
        return grant


def _traffic(rng: random.Random, svc: SchedulerService, clock: Clock, h: Holder, step: int) -> None:
    names = list(svc.engines)
    for _ in range(rng.randint(0, 6)):
        tid = f"t{step}-{rng.random()}"
        ask = Ask(prompt_tokens=rng.randint(10, 3000), ttft_budget_s=30.0, prefix=tuple(rng.sample(range(50), 3)),
                  prefix_block_tokens=16.0)
        if isinstance(h.lease.try_admit(tid, ask, clock() + 60, clock() + 5.0, 0.0), Placement) and rng.random() < 0.5:
            h.lease.release(tid, 3)
    for name in rng.sample(names, rng.randint(0, 4)):  # scrapes
        e = svc.engines[name]
        e.load = EngineLoad(running=rng.randint(0, 20), waiting=rng.randint(0, 5), kv_usage=rng.random())
        e.last_ok = clock.t
    if rng.random() < 0.2:  # an engine leaves, or comes back
        e = svc.engines[rng.choice(names)]
        e.healthy = not e.healthy
    clock.t += rng.choice([0.0, 0.01, 0.5])


def test_a_lease_synced_by_deltas_holds_the_schedulers_view_and_decides_as_on_it() -> None:
    rng = random.Random(11)
    svc, clock = _service(40)
    h = Holder(svc, clock)
    h.sync()
    assert h.grants[-1].view_base == 0 and len(h.grants[-1].view.engines) == 40  # the first is whole
    for step in range(200):
        _traffic(rng, svc, clock, h, step)
        h.sync()
        whole = svc.view(clock.t, frozen=True)
        assert h.lease.view is not None
        assert _facts(h.lease.view) == _facts(whole)
        ask = Ask(prompt_tokens=500, ttft_budget_s=30.0, prefix=tuple(rng.sample(range(50), 3)), prefix_block_tokens=16.0)
        here, there = decide(h.lease.view, ask, clock.t + 5.0, step), decide(whole, ask, clock.t, step)
        assert type(here) is type(there)
        if isinstance(here, Placement) and isinstance(there, Placement):
            assert [r.engines for r in here.routes] == [r.engines for r in there.routes]
            assert here.predicted_s == there.predicted_s
    deltas = [g for g in h.grants if g.view_base]
    assert len(deltas) == 200  # every grant after the first was a delta ...
    assert all(not g.view.engines for g in deltas)  # ... carrying their engines as rows ...
    assert sum(len(g.rows) for g in deltas) < 0.5 * 40 * 200  # ... a fraction of the fleet ...
    assert sum(1 for g in deltas for _, cfg, _ in g.rows if cfg is not None) == 0  # ... configs held already


def test_a_lost_grant_makes_the_next_one_whole() -> None:
    rng = random.Random(5)
    svc, clock = _service(12)
    h = Holder(svc, clock)
    h.sync()
    _traffic(rng, svc, clock, h, 0)
    assert h.sync().view_base != 0
    _traffic(rng, svc, clock, h, 1)
    h.sync(lose=True)  # the scheduler granted it; the ingress never saw it
    _traffic(rng, svc, clock, h, 2)
    g = h.sync()
    assert g.view_base == 0 and len(g.view.engines) == 12
    assert h.lease.view is not None and _facts(h.lease.view) == _facts(svc.view(clock.t, frozen=True))
    _traffic(rng, svc, clock, h, 3)
    assert h.sync().view_base != 0  # and deltas again


def test_a_delta_the_lease_cannot_place_leaves_its_view_and_asks_for_a_whole_one() -> None:
    svc, clock = _service(6)
    h = Holder(svc, clock)
    h.sync()
    before = h.lease.view
    h.lease.view_seq += 1  # as if it held some other view
    svc.engines["e0"].load = EngineLoad(running=9)
    svc.engines["e0"].last_ok = clock.t
    g = h.sync()
    assert g.view_base == 0  # the scheduler saw it claim a view it never sent: a whole one
    assert h.lease.view is not None and _facts(h.lease.view) == _facts(svc.view(clock.t, frozen=True))
    assert before is not None
    h.lease.view_seq += 1
    svc.engines["e0"].load = EngineLoad(running=3)
    g = svc.report(Report(lease=h.lease.cut(0.0)))
    assert g is not None and g.view_base == 0


def test_what_a_view_derives_for_decisions_stays_home() -> None:
    svc, clock = _service(200)
    view = svc.view(clock.t, frozen=True)
    size = len(pickle.dumps(view))
    decide(view, Ask(prompt_tokens=100, ttft_budget_s=5.0), clock.t, 0)  # builds its order and index
    assert len(pickle.dumps(view)) == size


def test_a_delta_carries_an_engines_config_only_when_it_changed() -> None:
    svc, clock = _service(6)
    h = Holder(svc, clock)
    h.sync()
    svc.engines["e0"].load = EngineLoad(running=2)
    svc.engines["e0"].last_ok = clock.t
    svc.views_stale()
    g = h.sync()
    assert g.view_base and [(name, cfg) for name, cfg, _ in g.rows] == [("e0", None)]
    new = svc.engines["e2"].cfg.model_copy(update={"max_num_seqs": 7})  # a reload changed it, same name
    svc.engines["e2"].cfg = new
    svc.views_stale()
    g = h.sync()
    assert g.view_base and [(name, cfg) for name, cfg, _ in g.rows] == [("e2", new)]
    assert h.lease.view is not None and h.lease.view.facts()["e2"].cfg == new
    assert _facts(h.lease.view) == _facts(svc.view(clock.t, frozen=True))


def test_a_prefix_set_changed_a_little_crosses_as_its_change() -> None:
    """A set of hundreds of blocks that gained or lost a few crosses as those (view.prefix_change),
    one mostly new or emptied crosses whole, and the lease holds exactly the scheduler's sets."""
    from narwhal_serve.admission.facts import prefix_change, with_prefix_change

    rng = random.Random(3)
    for _ in range(300):  # the change and the set made again from it, whatever the two sets
        pool = range(rng.randint(1, 400))
        held = frozenset(rng.sample(pool, rng.randint(0, len(pool))))
        new = frozenset(rng.sample(pool, rng.randint(0, len(pool)))) if rng.random() < 0.5 else \
            (held - set(rng.sample(sorted(held), min(len(held), 3)))) | {rng.randint(400, 500)}
        change = prefix_change(held, new)
        assert with_prefix_change(held, change) == new
        assert prefix_change(None, new) is new
    svc, clock = _service(8)
    for i, e in enumerate(svc.engines.values()):
        e.prefix.insert([i * 10**6 + b for b in range(400)])
    h = Holder(svc, clock)
    h.sync()
    fresh = 10**7
    for step in range(80):
        for name in rng.sample(list(svc.engines), 3):
            e = svc.engines[name]
            if rng.random() < 0.1:
                e.prefix.clear()  # (a restarted engine)
            elif rng.random() < 0.1:
                e.prefix.insert(list(range(fresh, fresh + 600)))  # mostly new
                fresh += 600
            else:
                e.prefix.insert(list(range(fresh, fresh + rng.randint(1, 30))))  # a request's blocks stored
                fresh += 30
                e.prefix.remove(rng.sample(sorted(e.prefix.held()), min(len(e.prefix), 5)))  # some evicted
            svc.touch(name)
        clock.t += 0.01
        h.sync()
        assert h.lease.view is not None and _facts(h.lease.view) == _facts(svc.view(clock.t, frozen=True)), step
        # the view's block index, passed from view to view and updated by the changes, is its sets'
        view = h.lease.view
        probe = sorted(set().union(*(f.prefix for f in view.engines)) | set(range(fresh - 700, fresh)))
        for b in rng.sample(probe, 60):
            assert view.holding(b) == frozenset(f.cfg.name for f in view.engines if b in f.prefix), (step, b)
    changes = [c for g in h.grants[1:] for c in (g.prefixes or {}).values()]
    assert all(g.view_base for g in h.grants[1:])
    small = [c for c in changes if isinstance(c, tuple)]
    assert len(small) > len(changes) // 2 and any(not isinstance(c, tuple) for c in changes)
    assert sum(len(a) + len(r) for a, r in small) < 0.2 * sum(len(f.prefix) for f in h.lease.view.engines) * len(small) / 8


def test_an_engine_gone_and_back_is_sent_its_whole_set() -> None:
    """An engine deregistered (a grant drops it from the lease's view) and registered again with
    most of its old blocks: its set crosses whole, not as a change from a set the lease no longer
    holds (the scheduler's record of what a lease holds follows the fleet's membership)."""
    svc, clock = _service(6)
    e = svc.engines["e0"]
    e.prefix.insert(list(range(100)))
    h = Holder(svc, clock)
    h.sync()
    cfg = e.cfg
    assert svc.deregister_engine("e0")
    clock.t += 0.01
    h.sync()
    assert h.lease.view is not None and "e0" not in h.lease.view.facts()
    svc.register_engine(cfg.model_copy())  # (parsed anew by the admin route)
    back = svc.engines["e0"]
    back.healthy, back.last_ok = True, clock.t
    back.prefix.insert(list(range(10, 105)))  # its KV events replayed: mostly the blocks it had
    clock.t += 0.01
    h.sync()
    assert h.lease.view is not None and _facts(h.lease.view) == _facts(svc.view(clock.t, frozen=True))
    assert set(h.lease.view.facts()["e0"].prefix) == set(range(10, 105))


def test_the_schedulers_decision_view_is_kept_from_decision_to_decision_and_equals_a_whole_one() -> None:
    """The scheduler's own decisions (its queue; every request without leases) are made on one view
    kept from decision to decision (the engines changed since merged in, its route order and block
    index passed on): its facts, holders and decisions equal a view made whole each time, through
    traffic, prefix sets changing, and engines leaving and coming back."""
    rng = random.Random(5)
    svc, clock = _service(24)
    h = Holder(svc, clock)
    fresh, indexes = 10**7, set()
    for step in range(150):
        _traffic(rng, svc, clock, h, step)
        for name in rng.sample(list(svc.engines), 2):
            e = svc.engines[name]
            e.prefix.insert(list(range(fresh, fresh + rng.randint(1, 20))))
            fresh += 20
            if rng.random() < 0.3:
                e.prefix.remove(rng.sample(sorted(e.prefix.held()), min(len(e.prefix), 5)))
            svc.touch(name)
        kept, whole = svc.decision_view(clock.t), svc.view(clock.t, frozen=True)
        assert _facts(kept) == _facts(whole), step
        for b in rng.sample(range(fresh - 400, fresh), 20):
            assert kept.holding(b) == whole.holding(b), (step, b)
        indexes.add(id(kept._derived.holders))
        prompt = tuple(range(fresh - 30, fresh - 30 + rng.randint(1, 30)))
        ask = Ask(prompt_tokens=500, ttft_budget_s=30.0, prefix=prompt, prefix_block_tokens=16.0)
        here, there = decide(kept, ask, clock.t, step), decide(whole, ask, clock.t, step)
        assert type(here) is type(there)
        if isinstance(here, Placement) and isinstance(there, Placement):
            assert [r.engines for r in here.routes] == [r.engines for r in there.routes], step
            assert (here.predicted_s, here.cached_tokens) == (there.predicted_s, there.cached_tokens), step
    assert len(indexes) == 1  # one block index passed from view to view, not made anew


def test_an_engine_gone_and_back_before_the_next_decision_takes_its_new_place_in_the_decision_view() -> None:
    """Deregistered and registered again between two decisions (the same names, the same count),
    an engine is last in the fleet's order: the scheduler's kept view follows, as a whole one does
    (the order breaks ties)."""
    svc, clock = _service(6)
    svc.decision_view(clock.t)
    cfg = svc.engines["e0"].cfg
    assert svc.deregister_engine("e0")
    svc.register_engine(cfg)
    e = svc.engines["e0"]
    e.healthy, e.last_ok = True, clock.t
    clock.t += 0.01
    kept, whole = svc.decision_view(clock.t), svc.view(clock.t, frozen=True)
    assert [f.cfg.name for f in kept.engines] == [f.cfg.name for f in whole.engines] == \
        ["e1", "e2", "e3", "e4", "e5", "e0"]


def test_leases_holding_the_same_set_share_its_change_computed_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two leases granted alike hold the same prefix set of an engine; when it changes, the change
    is computed for the first and given as is to the second (a set difference of hundreds of blocks
    per lease and changed engine was a tenth of the scheduler's report handling at 1,000 engines);
    a lease holding another set gets its own, and both hold exactly the scheduler's sets."""
    from narwhal_serve.admission import facts as facts_mod
    from narwhal_serve.scheduler import granted as granted_mod

    computed: list[int] = []

    def counted(held, new):  # type: ignore[no-untyped-def]
        computed.append(1)
        return facts_mod.prefix_change(held, new)

    monkeypatch.setattr(granted_mod, "prefix_change", counted)
    rng = random.Random(5)
    svc, clock = _service(6)
    for i, e in enumerate(svc.engines.values()):
        e.prefix.insert([i * 10**6 + b for b in range(300)])
    a, b = Holder(svc, clock), Holder(svc, clock)
    b.lease = AdmissionLease("i2")
    a.sync()
    b.sync()
    fresh = 10**7
    for step in range(40):
        names = rng.sample(list(svc.engines), 2)
        for name in names:
            svc.engines[name].prefix.insert(list(range(fresh, fresh + 12)))
            fresh += 12
            svc.touch(name)
        clock.t += 0.01
        before = len(computed)
        a.sync()
        b.sync()
        if step % 7 != 4:  # (after a step where b held older sets than a: one change more for some)
            assert len(computed) - before == len(names), step  # once per changed set, not once per lease
        for h in (a, b):
            assert h.lease.view is not None and _facts(h.lease.view) == _facts(svc.view(clock.t, frozen=True)), step
        if step % 7 == 3:  # a grant b does not see: b holds older sets than a, changed again since
            for name in names:
                svc.engines[name].prefix.insert([fresh])
                fresh += 1
                svc.touch(name)
            clock.t += 0.01
            a.sync()


def _eligibility_through_scrapes(seed: int) -> tuple[list[tuple[str, float, bool]], int]:
    """A lease's view through random scrapes, engines leaving and coming back and clock steps: for
    every engine, whether it is eligible at the grant and LEASE_TTL_S later; and the rows sent."""
    from narwhal_serve.scheduler.leases import LEASE_TTL_S

    rng = random.Random(seed)
    svc, clock = _service(12)
    h = Holder(svc, clock)
    h.sync()
    seen, sent = [], 0
    for _ in range(300):
        for name in rng.sample(list(svc.engines), rng.randint(0, 12)):  # scrapes answered, or not
            svc.engines[name].last_ok = clock.t
        if rng.random() < 0.1:
            e = svc.engines[rng.choice(list(svc.engines))]
            e.healthy = not e.healthy
        clock.t += rng.choice([0.01, 0.1, 0.3, 0.7, 1.0])
        sent += len(h.sync().rows)
        assert h.lease.view is not None
        for name, f in h.lease.view.facts().items():
            seen += [(name, t, f.eligible(t)) for t in (clock.t, clock.t + LEASE_TTL_S)]  # (the scheduler's times)
    return seen, sent


def test_scrapes_alone_re_send_an_engine_only_as_its_eligibility_nears_and_no_decision_changes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every answered scrape moves an engine's eligibility time (its last answer plus
    monitoring.stale_after_s); a grant keeps the one it sent while that is still KEEP_ELIGIBLE_S
    ahead, so a fleet scraped each second is not re-sent whole each second.  Whatever the scrapes
    and clock, a lease's view says an engine is eligible, for as long as the lease may use it
    (LEASE_TTL_S), exactly when it would with each new time sent."""
    from narwhal_serve.scheduler import granted as granted_mod
    from narwhal_serve.scheduler.granted import KEEP_ELIGIBLE_S

    svc, clock = _service(4)
    h = Holder(svc, clock)
    h.sync()
    t0, e = clock.t, svc.engines["e0"]
    stale = svc.cfg.monitoring.stale_after_s
    assert stale - 1.0 > KEEP_ELIGIBLE_S  # (the default config leaves room to keep it)
    clock.t, e.last_ok = t0 + 1.0, t0 + 1.0  # a scrape answered
    svc.touch("e0")
    assert "e0" not in [name for name, _, _ in h.sync().rows]  # its time kept: not re-sent
    assert h.lease.view is not None and h.lease.view.facts()["e0"].eligible_until == t0 + stale
    clock.t = e.last_ok = t0 + stale - KEEP_ELIGIBLE_S + 0.01  # the kept time nears: sent anew
    svc.touch("e0")
    assert "e0" in [name for name, _, _ in h.sync().rows]
    assert h.lease.view.facts()["e0"].eligible_until == clock.t + stale

    for seed in (17, 18):
        kept, kept_rows = _eligibility_through_scrapes(seed)
        with monkeypatch.context() as m:
            m.setattr(granted_mod, "KEEP_ELIGIBLE_S", math.inf)  # each new time sent
            each, each_rows = _eligibility_through_scrapes(seed)
        assert kept == each and any(not ok for _, _, ok in each) and any(ok for _, _, ok in each)
        assert kept_rows < 0.8 * each_rows, (kept_rows, each_rows)
