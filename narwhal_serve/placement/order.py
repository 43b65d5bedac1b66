"""The least loaded routes of a large fleet without scoring every engine per decision.

:func:`~narwhal_serve.placement.picker.candidate_routes` scores and sorts every eligible engine:
at 1,000 engines that is about 2 ms per decision, while a holder's view changes between two
grants in the few engines it placed on.  :class:`RouteOrder` sorts the engines once per view and
answers each decision from that order with those few engines re-scored: the first ``k`` routes,
exactly as ``candidate_routes(...)[:k]`` orders them (least loaded first by the rounded load score,
ties in the rotation's order; tested equal on random fleets), in O(k · sources · log E).

A source is a sorted list of ``(bucket, n)``: ``bucket`` the route's rounded load score, ``n`` its
place in the fleet's route enumeration (unified engines, then P/D routes by decode engine, both in
the fleet's order) that the rotation turns.  P/D routes of one dialect all pair with its least
loaded prefill engine, so their bucket is ``max(prefill's, decode's)``: the source holds the
decode engines' and is "clamped" to the prefill's.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Generic

from narwhal_serve.config import EngineConfig
from narwhal_serve.placement.picker import E, load_score
from narwhal_serve.protocol.placement import RouteChoice

_N = itemgetter(1)


def bucket(e: E) -> float:
    """The load score as routes are ordered by it (equal to the thousandth: a tie)."""
    return round(load_score(e), 3)


@dataclass
class _Source:
    keys: list[tuple[float, int]]  # (bucket, n), sorted
    clamp: float | None = None  # P/D: the paired prefill engine's bucket (every route's is at least it)
    prefill: EngineConfig | None = None

    def next_above(self, b: float) -> float | None:
        """The smallest bucket of a route here above ``b``."""
        if not self.keys:
            return None
        if self.clamp is not None and b < self.clamp:
            return self.clamp
        i = bisect_right(self.keys, (b, math.inf))
        return self.keys[i][0] if i < len(self.keys) else None

    def at(self, b: float, r: int, m: int) -> list[tuple[float, int]]:
        """Up to ``m`` routes of bucket ``b``, in the rotation's order from ``r``."""
        keys = self.keys
        if self.clamp is not None and b == self.clamp:  # every decode engine at or under the prefill's
            group = sorted(keys[:bisect_right(keys, (b, math.inf))], key=_N)
            lo, hi = 0, len(group)
            i = bisect_left(group, r, key=_N)
        elif self.clamp is not None and b < self.clamp:
            return []
        else:
            group = keys
            lo, hi = bisect_left(keys, (b, -1)), bisect_right(keys, (b, math.inf))
            i = bisect_left(keys, (b, r), lo, hi)
        out = group[i:min(hi, i + m)]
        if len(out) < m:
            out += group[lo:min(i, lo + m - len(out))]
        return [(b, n) for _, n in out]


# ``top(only=...)`` over a unified fleet sorts the engines of ``only`` when they are few
# (``ONLY_SHARE · |only| ≤ size``), else walks the fleet's order for the first of theirs: a key
# read in the walk costs about a twentieth of one sorted (a hundred holders of a common prompt
# start at 1,000 engines: 0.1 ms sorted, at most 0.05 ms walked)
ONLY_SHARE = 16


def _first(keys: list[tuple[float, int]], ns: Collection[int], k: int) -> list[tuple[float, int]]:
    """The first ``k`` keys (in order) of routes in ``ns``, and every one tied with the k-th (the
    rotation picks among ties)."""
    out: list[tuple[float, int]] = []
    for key in keys:
        if key[1] in ns:
            if len(out) >= k and key[0] != out[-1][0]:
                break
            out.append(key)
    return out


def _moved(keys: list[tuple[float, int]], moves: list[tuple[float, float, int]]) -> list[tuple[float, int]]:
    """``keys`` with route ``n`` moved from bucket ``was`` to ``now`` for each ``(was, now, n)`` (a
    copy; ``keys`` itself when nothing moves)."""
    if not moves:
        return keys
    out = list(keys)
    for was, now, n in moves:
        del out[bisect_left(out, (was, n))]
        insort(out, (now, n))
    return out


class RouteOrder(Generic[E]):
    """The routes over ``eligible`` engines (in the fleet's order), sorted once."""

    def __init__(self, eligible: Sequence[E]) -> None:
        self._engine: dict[str, E] = {e.cfg.name: e for e in eligible}
        self._bucket: dict[str, float] = {name: bucket(e) for name, e in self._engine.items()}
        self._n: dict[str, int] = {}  # the route an engine is the client-facing engine of
        self._cfg: list[EngineConfig] = []  # n -> that engine
        pd_dialects = {e.cfg.dialect for e in eligible if e.cfg.role == "prefill"} - {"openai"}
        for e in eligible:
            if e.cfg.role == "unified":
                self._add(e)
        self.first_pd = len(self._cfg)
        for e in eligible:
            if e.cfg.role == "decode" and e.cfg.dialect in pd_dialects:
                self._add(e)
        self.size = len(self._cfg)
        self._unified = sorted((self._bucket[c.name], n) for n, c in enumerate(self._cfg[:self.first_pd]))
        self._decodes: dict[str, list[tuple[float, int]]] = {d: [] for d in pd_dialects}
        for n in range(self.first_pd, self.size):
            c = self._cfg[n]
            self._decodes[c.dialect].append((self._bucket[c.name], n))
        for keys in self._decodes.values():
            keys.sort()
        # per dialect, the prefill engines by (load score, place): the first is every route's
        self._prefills: dict[str, list[tuple[float, int, str]]] = {d: [] for d in pd_dialects}
        for i, e in enumerate(eligible):
            if e.cfg.role == "prefill" and e.cfg.dialect in pd_dialects:
                self._prefills[e.cfg.dialect].append((load_score(e), i, e.cfg.name))
        for ps in self._prefills.values():
            ps.sort()
        self._place = {e.cfg.name: i for i, e in enumerate(eligible)}
        self._routes: dict[tuple[int, str | None], RouteChoice] = {}

    def updated(self, changed: Mapping[str, E]) -> "RouteOrder[E]":
        """This order with ``changed`` engines' new facts (the same engines eligible: a grant's
        changes, at O(changed · log E) and a copy of the lists); a change of an engine's role or
        dialect sorts anew."""
        mine = {name: f for name, f in changed.items() if name in self._engine}
        if any((f.cfg.role, f.cfg.dialect) != (self._engine[n].cfg.role, self._engine[n].cfg.dialect)
               for n, f in mine.items()):
            return RouteOrder([mine.get(name, e) for name, e in self._engine.items()])
        new: RouteOrder[E] = object.__new__(RouteOrder)
        new.__dict__.update(self.__dict__)
        new._engine = {**self._engine, **mine}
        new._bucket = {**self._bucket, **{name: bucket(f) for name, f in mine.items()}}
        new._cfg = list(self._cfg)
        new._routes = {}
        for name, f in mine.items():
            if (n := self._n.get(name)) is not None:
                new._cfg[n] = f.cfg
        new._unified = _moved(self._unified, [(self._bucket[name], new._bucket[name], self._n[name]) for name in mine
                                              if self._n.get(name, self.size) < self.first_pd])
        new._decodes = dict(self._decodes)
        new._prefills = dict(self._prefills)
        for dialect in self._decodes:
            new._decodes[dialect] = _moved(self._decodes[dialect], [
                (self._bucket[name], new._bucket[name], self._n[name]) for name, f in mine.items()
                if f.cfg.role == "decode" and f.cfg.dialect == dialect and name in self._n])
            ps = [name for name, f in mine.items() if f.cfg.role == "prefill" and f.cfg.dialect == dialect]
            if ps:
                kept = [p for p in self._prefills[dialect] if p[2] not in mine]
                new._prefills[dialect] = sorted(kept + [(load_score(mine[n]), self._place[n], n) for n in ps])
        return new

    def _add(self, e: E) -> None:
        self._n[e.cfg.name] = len(self._cfg)
        self._cfg.append(e.cfg)

    def __contains__(self, name: object) -> bool:
        return name in self._engine

    def _sources(self, changed: Mapping[str, E], only: Collection[str] | None, k: int,
                 rotation: int = 0) -> list[_Source]:
        if only is not None and not self._prefills and ONLY_SHARE * len(only) <= self.size:
            # a few engines of a unified fleet: just theirs, sorted
            unified = sorted((bucket(f) if (f := changed.get(name)) is not None else self._bucket[name], self._n[name])
                             for name in only if name in self._n and self._n[name] < self.first_pd)
            return [_Source(unified)]
        moved = {name: bucket(f) for name, f in changed.items() if name in self._engine}
        if only is not None and not self._prefills:
            # many (a prompt start most engines hold): the fleet's order, the first k of theirs
            keys = _moved(self._unified, [(self._bucket[name], b, self._n[name]) for name, b in moved.items()
                                          if self._n.get(name, self.size) < self.first_pd])
            return [_Source(_first(keys, {self._n[name] for name in only if name in self._n}, k))]
        if only is not None:
            unified = sorted((moved.get(name, self._bucket[name]), self._n[name]) for name in only
                             if name in self._n and self._n[name] < self.first_pd)
        else:
            unified = _moved(self._unified, [(self._bucket[name], b, self._n[name]) for name, b in moved.items()
                                             if self._n.get(name, self.size) < self.first_pd])
        sources = [_Source(unified)]
        for dialect, prefills in self._prefills.items():
            best = _tied_prefill(prefills, [(load_score(changed[name]), self._place[name], name) for name in moved
                                            if (c := self._engine[name].cfg).role == "prefill" and c.dialect == dialect],
                                 moved, rotation)
            if best is None or (only is not None and best[2] not in only):
                continue
            keys = _moved(self._decodes[dialect], [
                (self._bucket[name], b, self._n[name]) for name, b in moved.items()
                if (c := self._engine[name].cfg).role == "decode" and c.dialect == dialect and name in self._n])
            sources.append(_Source(keys, round(best[0], 3), self._engine[best[2]].cfg))
        return sources

    def top(self, k: int, rotation: int, changed: Mapping[str, E] | None = None,
            only: Collection[str] | None = None) -> list[RouteChoice]:
        """The ``k`` least loaded routes, ties in the order ``rotation`` turns them to, with the
        engines in ``changed`` scored as they are there; ``only``: just the routes whose
        first-token engine is one of these."""
        if self.size == 0 or k <= 0:
            return []
        return self._walk(self._sources(changed or {}, only, k, rotation), k, rotation % self.size)

    def _walk(self, sources: list[_Source], k: int, r: int) -> list[RouteChoice]:
        """The first ``k`` routes of ``sources`` by bucket, ties in the order ``r`` turns them to."""
        out: list[RouteChoice] = []
        b = -math.inf
        while len(out) < k:
            nexts = [x for s in sources if (x := s.next_above(b)) is not None]
            if not nexts:
                break
            b = min(nexts)
            m = k - len(out)
            group = [(n, s) for s in sources for _, n in s.at(b, r, m)]
            group.sort(key=lambda ns: (ns[0] - r) % self.size)
            for n, s in group[:m]:
                out.append(self._route(n, s.prefill))
        return out

    @property
    def has_prefills(self) -> bool:
        """Some P/D routes here (a dialect with eligible prefill engines)."""
        return bool(self._prefills)

    def prefill_holders(self, holding: Collection[str], k: int, changed: Mapping[str, E] | None = None) -> list[str]:
        """The ``k`` least loaded eligible prefill engines among ``holding`` (by load score, then
        place; the engines in ``changed`` scored as they are there)."""
        if not self._prefills:
            return []
        moved = changed or {}
        ones = [(s, i, name) for ps in self._prefills.values() for s, i, name in ps
                if name in holding and name not in moved]
        ones += [(load_score(f), self._place[name], name) for name, f in moved.items()
                 if name in holding and (e := self._engine.get(name)) is not None and e.cfg.role == "prefill"
                 and e.cfg.dialect in self._prefills]
        return [name for _, _, name in sorted(ones)[:k]]

    def over(self, prefill: str, k: int, rotation: int, changed: Mapping[str, E] | None = None) -> list[RouteChoice]:
        """The ``k`` least loaded P/D routes through prefill engine ``prefill`` (a dialect's routes
        pair with its least loaded one: these pair one that holds the prompt's prefix), ties in the
        rotation's order."""
        moved = changed or {}
        e = moved.get(prefill, self._engine.get(prefill))
        if e is None or e.cfg.role != "prefill" or e.cfg.dialect not in self._decodes or self.size == 0:
            return []
        dialect = e.cfg.dialect
        keys = _moved(self._decodes[dialect], [
            (self._bucket[name], bucket(f), self._n[name]) for name, f in moved.items()
            if name in self._n and (c := self._engine[name].cfg).role == "decode" and c.dialect == dialect])
        return self._walk([_Source(keys, bucket(e), e.cfg)], k, rotation % self.size)

    def other_prefill(self, dialect: str, but: str, changed: Mapping[str, E] | None = None,
                      fits: Callable[[str], bool] = lambda _: True) -> EngineConfig | None:
        """The least loaded eligible prefill engine of ``dialect`` other than ``but`` that ``fits``
        (by load score, then place; the engines in ``changed`` scored as they are there), or None."""
        moved = changed or {}
        out = next(((s, i, name) for s, i, name in self._prefills.get(dialect, ())
                    if name != but and name not in moved and fits(name)), None)
        for name, f in moved.items():
            e = self._engine.get(name)
            if e is not None and name != but and e.cfg.role == "prefill" and e.cfg.dialect == dialect and fits(name):
                mine = (load_score(f), self._place[name], name)
                out = mine if out is None or mine < out else out
        return None if out is None else moved.get(out[2], self._engine[out[2]]).cfg

    def _route(self, n: int, prefill: EngineConfig | None) -> RouteChoice:
        """Route ``n`` (over ``prefill`` for a P/D route), one object per order (a decision takes
        about 16: made anew, a tenth of a lease's decision at 16 engines)."""
        key = (n, None if prefill is None else prefill.name)
        route = self._routes.get(key)
        if route is None or route.prefill is not prefill:
            cfg = self._cfg[n]
            route = self._routes[key] = (RouteChoice(kind="single", decode=cfg) if prefill is None
                                         else RouteChoice(kind="pd", decode=cfg, prefill=prefill))
        return route


def _tied_prefill(prefills: list[tuple[float, int, str]], moved_ones: list[tuple[float, int, str]],
                  moved: Collection[str], rotation: int) -> tuple[float, int, str] | None:
    """The prefill engine of a dialect's P/D routes: the least loaded, and among those equally
    loaded (idle ones, say) the one ``rotation`` turns to in the fleet's order — as
    :func:`~narwhal_serve.placement.picker.candidate_routes` picks it (every lease put its next
    request on the fleet's first idle prefill engine).  ``prefills``: sorted (load, place, name),
    stale for the ``moved`` engines, whose entries are ``moved_ones``."""
    first = next((p for p in prefills if p[2] not in moved), None)
    scores = ([first[0]] if first is not None else []) + [p[0] for p in moved_ones]
    if not scores:
        return None
    lo = min(scores)
    ties = [p for p in itertools.takewhile(lambda p: p[0] <= lo, prefills) if p[2] not in moved]
    if moved_ones:
        ties = sorted(ties + [p for p in moved_ones if p[0] == lo], key=lambda p: p[1])
    return ties[rotation % len(ties)]
