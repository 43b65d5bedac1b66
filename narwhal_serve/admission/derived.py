"""What a fleet view derives for its decisions and keeps home (:mod:`.view`): the engines by name,
the route order of the engines eligible, which engines hold each block (an index that passes from
view to view), and the holder's changes over the engines.  Not sent over the Ray hop: a view's
receiver makes its own, and a view merged from a grant takes its predecessor's, updated."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet

from narwhal_serve.admission.facts import EngineFacts
from narwhal_serve.placement.order import RouteOrder
from narwhal_serve.prediction.decode import tpot_at


class Derived:
    """What a view's decisions share, made on first use: the engines by name, the route order of
    the engines eligible (and the time window it holds for), which engines hold each block
    (:class:`Holders`).  A view merged from a grant's changes takes its predecessor's, updated for
    the engines changed (:meth:`evolved`), at the cost of those.  A view's receiver makes its own:
    it is not sent over the Ray hop."""

    __slots__ = ("engines", "by_name", "cold", "order", "window", "holders", "_place", "_context")

    def __init__(self) -> None:
        self.engines: tuple[EngineFacts, ...] | None = None

    def __reduce__(self) -> tuple[type["Derived"], tuple[()]]:
        return (Derived, ())

    def of(self, engines: tuple[EngineFacts, ...]) -> "Derived":
        if self.engines is not engines:
            self.engines = engines
            self.by_name: dict[str, EngineFacts] = {e.cfg.name: e for e in engines}
            self.cold = cold_tpot(engines)
            self.order: RouteOrder[EngineFacts] | None = None
            self.window = (math.inf, -math.inf)
            self.holders: Holders | None = None  # made on the first look-up
            self._place: dict[str, int] | None = None
            self._context: FleetContext | None = None
        return self

    def context(self) -> "FleetContext":
        """The fleet's engines' contexts, as they said them (made on first use)."""
        if self._context is None:
            assert self.engines is not None
            self._context = FleetContext.of(self.engines)
        return self._context

    def place(self) -> dict[str, int]:
        """Each engine's place in the fleet's order."""
        if self._place is None:
            assert self.engines is not None
            self._place = {e.cfg.name: i for i, e in enumerate(self.engines)}
        return self._place

    def evolved(self, engines: tuple[EngineFacts, ...], changed: Mapping[str, EngineFacts],
                moves: Mapping[str, tuple[AbstractSet[int], AbstractSet[int]]] | None = None) -> "Derived":
        """Derived data of ``engines``: these engines, with ``changed`` (by name) new.  The block
        index passes to the new view, updated by the changed engines' sets: the blocks each lost
        and gained, from ``moves`` where known there (a grant's prefix changes), else compared
        (this view makes its own again if it is asked after: views are followed forward)."""
        new = Derived()
        new.engines = engines
        new.by_name = {**self.by_name, **changed}
        new.cold = self._cold_after(engines, changed)
        new.order, new.window = None, (math.inf, -math.inf)
        if self.order is not None:
            # the same engines in the order: the window narrows to what the changed ones allow
            # (an engine refreshed may widen it: the order is made again when ``now`` leaves it)
            order, (lo, hi) = self.order, self.window
            new.order = order.updated({n: f for n, f in changed.items() if n in order})
            new.window = (max([lo] + [f.eligible_until for n, f in changed.items() if n not in order]),
                          min([hi] + [f.eligible_until for n, f in changed.items() if n in order]))
        new._place = self._place  # (the same engines)
        # (a context changes when an engine is restarted with another: rare; the rest keep it)
        new._context = self._context if all(f.context == self.by_name[n].context for n, f in changed.items()) else None
        new.holders, self.holders = self.holders, None
        if new.holders is not None:
            for name, f in changed.items():
                was = self.by_name[name].prefix
                if was is not f.prefix:
                    move = moves.get(name) if moves else None
                    if move is None:
                        was, now = _set(was), _set(f.prefix)
                        move = (was.difference(now), now.difference(was))
                    new.holders.moved(name, *move)
        return new

    def _cold_after(self, engines: tuple[EngineFacts, ...], changed: Mapping[str, EngineFacts]
                    ) -> tuple[float, float] | None:
        """:func:`cold_tpot` of ``engines`` (this view's with ``changed`` new): the best of this
        view's and the changed engines' models, unless an engine that had this view's best
        changed its model or two models tie (then all are looked at again)."""
        cold, better = self.cold, []
        for name, f in changed.items():
            o = self.by_name[name]
            if (f.tpot_a, f.tpot_b, f.tpot_known) == (o.tpot_a, o.tpot_b, o.tpot_known):
                continue
            if o.tpot_known and (o.tpot_a, o.tpot_b) == cold:
                return cold_tpot(engines)
            if f.tpot_known:
                better.append((f.tpot_a, f.tpot_b))
        if not better:
            return cold
        ranked = sorted((tpot_at(a, b, 1.0), (a, b)) for a, b in ([cold, *better] if cold is not None else better))
        if len(ranked) > 1 and ranked[0][0] == ranked[1][0] and ranked[0][1] != ranked[1][1]:
            return cold_tpot(engines)  # a tie: the first in the fleet's order wins, as there
        return ranked[0][1]

    def holding(self, block: int) -> frozenset[str]:
        """The engines whose set holds ``block``."""
        if self.holders is None:
            self.holders = Holders({n: f.prefix for n, f in self.by_name.items()})
        return self.holders.of(block)


class Holders:
    """Which engines hold each block (an inverted index of the engines' prefix sets): its one
    holder's name, as most blocks have one, else the set of them.  A look-up is one dict read; an
    engine's set changing costs the blocks it gained and lost."""

    __slots__ = ("_by_block",)

    def __init__(self, sets: Mapping[str, AbstractSet[int]]) -> None:
        self._by_block: dict[int, str | set[str]] = {}
        for name, blocks in sets.items():
            self.moved(name, (), blocks)

    def of(self, block: int) -> frozenset[str]:
        held = self._by_block.get(block)
        if held is None:
            return frozenset()
        return frozenset((held,)) if isinstance(held, str) else frozenset(held)

    def moved(self, name: str, lost: Iterable[int], gained: AbstractSet[int]) -> None:
        """Engine ``name``'s set lost the blocks ``lost`` and gained ``gained`` (none of which it held)."""
        by = self._by_block
        for b in lost:
            held = by.get(b)
            if held == name:
                del by[b]
            elif isinstance(held, set):
                held.discard(name)
                if len(held) == 1:
                    by[b] = next(iter(held))
        if not gained:
            return
        # the blocks nobody held in one C call (most of them: a set's difference with a dict looks
        # up each of the set's members), the rest one by one
        fresh = _set(gained).difference(by)
        by.update(dict.fromkeys(fresh, name))
        for b in _set(gained).difference(fresh) if len(fresh) < len(gained) else ():
            held = by[b]
            if isinstance(held, str):
                if held != name:
                    by[b] = {held, name}
            else:
                held.add(name)


class FactsOver(Mapping[str, EngineFacts]):
    """The view's engines by name with the holder's changes over them (a read is two dict reads)."""

    __slots__ = ("changed", "base")

    def __init__(self, changed: Mapping[str, EngineFacts], base: dict[str, EngineFacts]) -> None:
        self.changed, self.base = changed, base

    def __getitem__(self, name: str) -> EngineFacts:
        f = self.changed.get(name)
        return self.base[name] if f is None else f

    def get(self, name: str, default: EngineFacts | None = None) -> EngineFacts | None:  # type: ignore[override]
        f = self.changed.get(name)
        return self.base.get(name, default) if f is None else f

    def __contains__(self, name: object) -> bool:
        return name in self.base or name in self.changed

    def __iter__(self) -> Iterator[str]:
        return iter(self.base.keys() | self.changed.keys())

    def __len__(self) -> int:
        return len(self.base.keys() | self.changed.keys())


def _set(s: AbstractSet[int]) -> set[int] | frozenset[int]:
    return s if isinstance(s, (set, frozenset)) else frozenset(s)


def holding_with(held: frozenset[str], changed: Mapping[str, EngineFacts], block: int) -> frozenset[str]:
    """``held`` (the holders of ``block`` among some engines' facts) with ``changed`` engines' new
    facts in place of theirs."""
    return (held - changed.keys()) | {n for n, f in changed.items() if block in f.prefix}


def cold_tpot(engines: tuple[EngineFacts, ...]) -> tuple[float, float] | None:
    known = [(f.tpot_a, f.tpot_b) for f in engines if f.tpot_known]
    return min(known, key=lambda ab: tpot_at(ab[0], ab[1], 1.0)) if known else None


class FleetContext:
    """The contexts (``max_model_len``) the fleet's engines said: the ``shortest`` and the
    ``longest`` of them (0: none said), whether ``every`` engine has said one, and, per prompt
    length, the engines it fits (:meth:`room`, kept per distinct context: a view has a few)."""

    __slots__ = ("shortest", "longest", "every", "_by", "_levels", "_room")

    def __init__(self, shortest: int, longest: int, every: bool, by: dict[str, int]) -> None:
        self.shortest, self.longest, self.every, self._by = shortest, longest, every, by
        self._levels = sorted({c for c in by.values() if c})  # the distinct contexts said (a few)
        self._room: dict[int, frozenset[str]] = {}

    @classmethod
    def of(cls, engines: Iterable[EngineFacts]) -> "FleetContext":
        by = {e.cfg.name: e.context for e in engines}
        said = [c for c in by.values() if c]
        return cls(min(said, default=0), max(said, default=0), len(said) == len(by), by)

    def room(self, prompt_tokens: int) -> frozenset[str]:
        """The engines a prompt this long fits (an engine that did not say its context included)."""
        i = bisect.bisect_right(self._levels, prompt_tokens)
        floor = self._levels[i] if i < len(self._levels) else 0  # the shortest context it fits
        out = self._room.get(floor)
        if out is None:
            out = self._room[floor] = frozenset(n for n, c in self._by.items() if not c or c > prompt_tokens)
        return out
