"""placement/order.py against the picker it stands in for: on random fleets (roles, dialects,
loads, a few engines changed since the order was made, any rotation), ``RouteOrder.top(k)`` is
``candidate_routes(...)[:k]`` route for route, the ``only`` filter is the picker's routes filtered
by first-token engine, and an order ``updated`` with changes answers as one made anew."""

from __future__ import annotations

import random
from dataclasses import replace

from narwhal_serve.admission.facts import EngineFacts
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.order import RouteOrder
from narwhal_serve.placement.picker import candidate_routes
from narwhal_serve.protocol.placement import RouteChoice


def _fleet(rng: random.Random, n: int) -> list[EngineFacts]:
    out = []
    for i in range(n):
        role, dialect = rng.choice(["unified", "prefill", "decode"]), rng.choice(["vllm", "vllm", "sglang", "openai"])
        cfg = EngineConfig(name=f"e{i}", url=f"http://127.0.0.1:{9000 + i}",
                           role="unified" if dialect == "openai" else role,  # (the config refuses openai P/D)
                           dialect=dialect)
        load = EngineLoad(running=rng.choice([0, 1, 3]), waiting=rng.choice([0, 0, 2]), kv_usage=rng.choice([0.0, 0.5, 0.0004]))
        out.append(EngineFacts(cfg=cfg, eligible_until=10.0, inflight=rng.choice([0, 0, 1, 2, 5, 30, 64]), load=load,
                               pending_prefill_tokens=0, ttft_a=0.1, ttft_b=0.001, slots=None, service_s=None))
    return out


def _engines(routes: list[RouteChoice]) -> list[tuple[str, ...]]:
    return [r.engines for r in routes]


def _first_token(r: RouteChoice) -> str:
    return r.prefill.name if r.prefill else r.decode.name


def _case(rng: random.Random, fleet: list[EngineFacts]
          ) -> tuple[RouteOrder[EngineFacts], dict[str, EngineFacts], int, int, list[RouteChoice]]:
    """An order of ``fleet``, a few engines changed since, a rotation and a k, and the picker's
    routes over the fleet as it is now."""
    order = RouteOrder(fleet)
    changed = {e.cfg.name: replace(e, inflight=max(0, e.inflight + rng.choice([-3, 1, 2, 40])))
               for e in rng.sample(fleet, min(len(fleet), rng.randint(0, 4)))}
    now = [changed.get(e.cfg.name, e) for e in fleet]
    rotation, k = rng.randint(0, 100), rng.randint(1, 12)
    return order, changed, rotation, k, candidate_routes(now, rotation, limit=None)


def test_top_is_the_pickers_first_routes_with_changes_and_filters() -> None:
    rng = random.Random(7)
    for _ in range(1500):
        fleet = _fleet(rng, rng.randint(0, 40))
        order, changed, rotation, k, ref = _case(rng, fleet)
        assert _engines(order.top(k, rotation, changed)) == _engines(ref[:k])
        only = set(rng.sample([e.cfg.name for e in fleet], min(len(fleet), rng.randint(0, 6))))
        assert _engines(order.top(k, rotation, changed, only=only)) == _engines([r for r in ref if _first_token(r) in only][:k])


def test_top_among_many_of_a_unified_fleet_is_the_pickers_filtered() -> None:
    """``only`` many of a unified fleet (the holders of a common prompt start): the first of theirs
    in the fleet's order (``ONLY_SHARE``), as the picker's filtered routes, ties rotated."""
    rng = random.Random(9)
    for _ in range(1500):
        fleet = [replace(e, cfg=e.cfg.model_copy(update={"role": "unified"})) for e in _fleet(rng, rng.randint(1, 60))]
        order, changed, rotation, k, ref = _case(rng, fleet)
        only = set(rng.sample([e.cfg.name for e in fleet], rng.randint(len(fleet) // 16, len(fleet))))
        assert _engines(order.top(k, rotation, changed, only=only)) == _engines([r for r in ref if _first_token(r) in only][:k])


def test_ties_rotate_over_a_large_idle_fleet() -> None:
    fleet = _fleet(random.Random(1), 0)
    fleet = [EngineFacts(cfg=EngineConfig(name=f"u{i}", url=f"http://127.0.0.1:{9000 + i}"), eligible_until=10.0,
                         inflight=0, load=EngineLoad(), pending_prefill_tokens=0, ttft_a=0.1, ttft_b=0.001, slots=None,
                         service_s=None) for i in range(1000)]
    order = RouteOrder(fleet)
    firsts = [order.top(1, rotation)[0].decode.name for rotation in range(1000)]
    assert len(set(firsts)) == 1000  # every idle engine takes its turn first
    busy = {"u5": replace(fleet[5], inflight=3)}  # the one engine with work goes last
    assert "u5" not in [r.decode.name for r in order.top(999, 5, busy)]
    assert order.top(1000, 5, busy)[-1].decode.name == "u5"


def test_updated_answers_as_an_order_made_anew() -> None:
    rng = random.Random(3)
    for _ in range(1000):
        fleet = _fleet(rng, rng.randint(0, 40))
        order = RouteOrder(fleet)
        changed = {e.cfg.name: replace(e, inflight=e.inflight + rng.choice([1, 2, 40]),
                                       load=EngineLoad(running=rng.choice([0, 5]), waiting=rng.choice([0, 3])))
                   for e in rng.sample(fleet, min(len(fleet), rng.randint(0, 5)))}
        if fleet and rng.random() < 0.1:  # a reload gave an engine another role
            e = rng.choice(fleet)
            changed[e.cfg.name] = replace(e, cfg=e.cfg.model_copy(update={"role": rng.choice(["unified", "prefill", "decode"])}))
        now = [changed.get(e.cfg.name, e) for e in fleet]
        updated, fresh = order.updated(changed), RouteOrder(now)
        rotation, k = rng.randint(0, 50), rng.randint(1, 10)
        assert _engines(updated.top(k, rotation)) == _engines(fresh.top(k, rotation))
        mine = {e.cfg.name: replace(e, inflight=e.inflight + 3) for e in rng.sample(now, min(len(now), 2))}
        assert _engines(updated.top(k, rotation, mine)) == _engines(fresh.top(k, rotation, mine))
