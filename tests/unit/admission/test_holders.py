"""A view's holders of a block and its deepest holders of a prompt, through a chain of grants'
deltas (each view's block index passed on and updated by the changed engines' sets, and a
holder's own changes over it), equal the engines' prefix sets looked at one by one; its best TPOT
model, kept from view to view, equals a look at every engine's."""

from __future__ import annotations

import random
from dataclasses import replace

from narwhal_serve.admission.derived import cold_tpot
from narwhal_serve.admission.facts import EngineFacts
from narwhal_serve.admission.view import FleetView
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.prefix import SetUnion

BLOCKS = 40


def _facts(i: int, prefix: frozenset[int]) -> EngineFacts:
    return EngineFacts(cfg=EngineConfig(name=f"u{i}", url=f"http://127.0.0.1:{9000 + i}"), eligible_until=10.0,
                       inflight=0, load=EngineLoad(), pending_prefill_tokens=0, ttft_a=0.01, ttft_b=1e-4,
                       slots=None, service_s=None, prefix=prefix)


def _prefix(rng: random.Random) -> frozenset[int]:
    """A cache's blocks: a prompt's first ``n`` (caches fill and evict from a prefix's end), or a few
    at random (an engine whose blocks are not one prefix)."""
    if rng.random() < 0.8:
        return frozenset(range(rng.randint(0, BLOCKS)))
    return frozenset(rng.sample(range(BLOCKS), rng.randint(0, 6)))


def _deepest(engines: dict[str, EngineFacts], prompt: tuple[int, ...]) -> frozenset[str]:
    """``FleetView.deepest`` by definition: halving the depth over every engine's set."""
    held = frozenset(n for n, f in engines.items() if prompt and prompt[0] in f.prefix)
    lo, hi = 0, len(prompt) - 1
    while held and lo < hi:
        mid = (lo + hi + 1) // 2
        deeper = frozenset(n for n in held if prompt[mid] in engines[n].prefix)
        if deeper:
            lo, held = mid, deeper
        else:
            hi = mid - 1
    return held


def test_holders_through_a_chain_of_deltas_equal_a_look_at_every_engine() -> None:
    rng = random.Random(3)
    size = 192
    current = {f"u{i}": _facts(i, _prefix(rng)) for i in range(size)}
    view = FleetView(engines=tuple(current.values()), unavailable=None, predictive=True)
    for step in range(120):
        changed = rng.sample(sorted(current), rng.choice([0, 1, 3, 20, size // 2]))
        for name in changed:  # a new set, or the same set with other facts changed
            current[name] = replace(current[name], prefix=_prefix(rng)) if rng.random() < 0.8 else \
                replace(current[name], inflight=current[name].inflight + 1)
            if rng.random() < 0.3:  # its TPOT model learned, or forgotten
                current[name] = replace(current[name], tpot_known=rng.random() < 0.8, tpot_a=rng.choice([0.01, 0.02]),
                                        tpot_b=rng.choice([1e-4, 2e-4, 3e-4]))
        delta = FleetView(engines=tuple(current[n] for n in changed), unavailable=None, predictive=True)
        merged = view.merged(delta, ())
        assert merged is not None
        if step % 10 == 3:  # a view asked after its successor took its index still answers for its own engines
            block = rng.randrange(BLOCKS)
            assert view.holding(block) == frozenset(f.cfg.name for f in view.engines if block in f.prefix)
        view = merged
        assert view.cold_tpot() == cold_tpot(view.engines)  # (kept from view to view)
        own = {}  # the holder's own placements since, over the view
        for name in rng.sample(sorted(current), rng.choice([0, 0, 2])):
            own[name] = replace(current[name], prefix=current[name].prefix | {rng.randrange(BLOCKS)})
        looked = FleetView(engines=view.engines, unavailable=None, predictive=True, changed=own,
                           _derived=view._derived) if own else view
        seen = {**current, **own}
        for _ in range(6):
            block = rng.randrange(BLOCKS)
            assert looked.holding(block) == frozenset(n for n, f in seen.items() if block in f.prefix)
            start = rng.randrange(BLOCKS)
            prompt = tuple(range(start, min(BLOCKS, start + rng.randint(1, BLOCKS))))
            assert looked.deepest(prompt) == _deepest(seen, prompt), (step, prompt)


def test_a_tie_of_tpot_models_goes_to_the_first_engine_in_the_fleets_order_as_a_look_at_every_engine() -> None:
    """Two models with the same TPOT at one sequence: the view kept from view to view takes the one
    of the engine first in the fleet's order, as cold_tpot does (an engine with no model is ranked
    with it, and at larger batches the two differ)."""
    e0, e1 = replace(_facts(0, frozenset()), tpot_known=False), \
        replace(_facts(1, frozenset()), tpot_known=True, tpot_a=0.5, tpot_b=0.25)
    view = FleetView(engines=(e0, e1), unavailable=None, predictive=True)
    assert view.cold_tpot() == (0.5, 0.25)
    learned = replace(e0, tpot_known=True, tpot_a=0.25, tpot_b=0.5)
    merged = view.merged(FleetView(engines=(learned,), unavailable=None, predictive=True), ())
    assert merged is not None and merged.cold_tpot() == cold_tpot(merged.engines) == (0.25, 0.5)


def test_holders_of_sets_that_are_unions_of_sets() -> None:
    """An engine's set may be a union over its sets (a holder's placements, blocks pending): the
    index takes it as any set."""
    a, b = _facts(0, frozenset({1, 2})), _facts(1, SetUnion(frozenset({1}), frozenset({3})))
    view = FleetView(engines=(a, b), unavailable=None, predictive=True)
    assert (view.holding(1), view.holding(2), view.holding(3)) == \
        (frozenset({"u0", "u1"}), frozenset({"u0"}), frozenset({"u1"}))
    assert view.deepest((1, 3)) == frozenset({"u1"})
