"""Placement: eligibility filter → load score in [0, 1] → ordered candidate routes.

Single-engine routes come from unified engines; P/D routes pair a prefill and a decode engine of the
same dialect (two independent picks, as llm-d and the SGLang gateway do).  Ties rotate, so equal
routes share the load: over the routes in the fleet's order (unified engines, then P/D routes by
decode engine).  :mod:`.order` gives the same first routes of a large fleet without scoring it all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.protocol.placement import RouteChoice


class Scorable(Protocol):
    """What placement reads of an engine (the scheduler's state or a holder's frozen facts)."""

    @property
    def cfg(self) -> EngineConfig: ...

    @property
    def inflight(self) -> int: ...

    @property
    def load(self) -> EngineLoad: ...


E = TypeVar("E", bound=Scorable)

MAX_CANDIDATES = 3


def load_score(e: Scorable, max_num_seqs_hint: float = 64.0) -> float:
    """0 = idle, 1 = saturated: router in-flight and engine queue against a nominal batch size."""
    busy = max(e.inflight, e.load.running) + 2.0 * e.load.waiting
    return min(1.0, max(busy / max_num_seqs_hint, e.load.kv_usage))


def candidate_routes(eligible: Sequence[E], rotation: int, limit: int | None = MAX_CANDIDATES) -> list[RouteChoice]:
    """Ordered routes over ``eligible`` engines, best first by load, at most ``limit`` (None: all,
    for a caller that ranks them itself)."""
    scored: list[tuple[float, int, RouteChoice]] = []
    unified = [e for e in eligible if e.cfg.role == "unified"]
    prefills = sorted((e for e in eligible if e.cfg.role == "prefill"), key=load_score)
    decodes = [e for e in eligible if e.cfg.role == "decode"]  # in the fleet's order: the rotation's
    n = 0
    for e in unified:
        scored.append((load_score(e), n, RouteChoice(kind="single", decode=e.cfg)))
        n += 1
    firsts: dict[str, Scorable] = {}  # per dialect: the least loaded prefill; equally loaded ones take turns
    for dialect in {p.cfg.dialect for p in prefills}:
        mine = [p for p in prefills if p.cfg.dialect == dialect]
        ties = [p for p in mine if load_score(p) == load_score(mine[0])]
        firsts[dialect] = ties[rotation % len(ties)]
    for d in decodes:
        p = firsts.get(d.cfg.dialect)
        if p is not None and d.cfg.dialect != "openai":
            score = max(load_score(p), load_score(d))
            scored.append((score, n, RouteChoice(kind="pd", decode=d.cfg, prefill=p.cfg)))
            n += 1
    if not scored:
        return []
    # rotate tie order so equal scores alternate between routes
    n_routes = len(scored)  # (list.sort empties the list while it sorts)
    scored.sort(key=lambda s: (round(s[0], 3), (s[1] - rotation) % n_routes))
    return [r for _, _, r in (scored if limit is None else scored[:limit])]


def resume_targets(eligible: Sequence[E]) -> list[EngineConfig]:
    """The engines an answer cut mid-stream may continue on (docs/contract.md, "Mid-stream resume"): every
    route's client-facing engine, least loaded first, each once."""
    out: dict[str, EngineConfig] = {}
    for r in candidate_routes(eligible, 0, limit=None):
        out.setdefault(r.decode.name, r.decode)
    return list(out.values())
