"""Placement prefers engines on the ingress's own Ray node when expected completion times tie (to
the millisecond), and only then: a cheaper engine elsewhere still wins, and without node facts the
ranking is exactly the cost's."""

from __future__ import annotations

from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.config import EngineConfig
from tests.unit.admission.test_overload_decisions import NOW, engine, view


def first(v, ask: Ask, rotation: int) -> str:  # type: ignore[no-untyped-def]
    out = decide(v, ask, NOW, rotation)
    assert isinstance(out, Placement), out
    return out.routes[0].decode.name


def test_a_tie_goes_to_the_engine_on_the_ingress_s_node_whatever_the_rotation() -> None:
    v = view(engine("far", node="node-b"), engine("near", node="node-a"))
    assert {first(v, Ask(100, 2.0, node="node-a"), r) for r in range(4)} == {"near"}
    assert {first(v, Ask(100, 2.0, node="node-b"), r) for r in range(4)} == {"far"}


def test_without_a_node_ties_rotate_as_before() -> None:
    v = view(engine("far", node="node-b"), engine("near", node="node-a"))
    assert {first(v, Ask(100, 2.0), r) for r in range(4)} == {"far", "near"}
    # engines by URL (no node known) are never "near": an ingress with a node rotates among them
    w = view(engine("u1"), engine("u2"))
    assert {first(w, Ask(100, 2.0, node="node-a"), r) for r in range(4)} == {"u1", "u2"}


def test_a_cheaper_engine_elsewhere_still_wins() -> None:
    v = view(engine("far", node="node-b"), engine("near", node="node-a", pending_prefill_tokens=2000))
    assert {first(v, Ask(100, 2.0, node="node-a"), r) for r in range(4)} == {"far"}


def test_a_pd_route_is_near_only_when_both_legs_are() -> None:
    def leg(name: str, role: str, node: str):  # type: ignore[no-untyped-def]
        return engine(name, node=node, cfg=EngineConfig(name=name, url=f"http://127.0.0.1:{len(name) + 9000}", role=role))
    v = view(leg("p-near", "prefill", "node-a"), leg("d-far", "decode", "node-b"),
             leg("p-far", "prefill", "node-b"), leg("d-near", "decode", "node-a"))
    out = decide(v, Ask(100, 2.0, node="node-a"), NOW, 0)
    assert isinstance(out, Placement)
    assert out.routes[0].engines == ("p-near", "d-near"), out.routes[0].engines
