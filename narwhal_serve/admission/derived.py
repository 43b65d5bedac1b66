"""What a fleet view derives for its decisions and keeps home (:mod:`.view`): the engines by name,
the route order of the engines eligible, which engines hold a block (remembered, and read through
the views before), and the holder's changes over the engines.  Not sent over the Ray hop: a view's
receiver makes its own, and a view merged from a grant takes its predecessor's, updated."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet

from narwhal_serve.admission.facts import EngineFacts
from narwhal_serve.placement.order import RouteOrder
from narwhal_serve.prediction.decode import tpot_at


class Derived:
    """What a view's decisions share, made on first use: the engines by name, the route order of
    the engines eligible (and the time window it holds for), which engines hold a block.  A view
    merged from a grant's changes takes its predecessor's, updated for the engines changed
    (:meth:`evolved`), at the cost of those.  A view's receiver makes its own: it is not sent over
    the Ray hop."""

    __slots__ = ("engines", "by_name", "cold", "order", "window", "holders", "before", "_place", "prefix_of")

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
            self.holders: dict[int, frozenset[str]] = {}
            # the views before's holders, each with the engines changed after it (read through,
            # corrected), the latest first; at most HOLDERS_BEFORE
            self.before: tuple[tuple[dict[int, frozenset[str]], Mapping[str, EngineFacts]], ...] = ()
            self._place: dict[str, int] | None = None
            self.prefix_of: dict[str, AbstractSet[int]] | None = None  # each engine's prefix set by name
        return self

    def prefixes(self) -> dict[str, AbstractSet[int]]:
        """Each engine's prefix set by name (a scan of the fleet or of some engines reads no attributes)."""
        if self.prefix_of is None:
            self.prefix_of = {name: f.prefix for name, f in self.by_name.items()}
        return self.prefix_of

    def place(self) -> dict[str, int]:
        """Each engine's place in the fleet's order."""
        if self._place is None:
            assert self.engines is not None
            self._place = {e.cfg.name: i for i, e in enumerate(self.engines)}
        return self._place

    def evolved(self, engines: tuple[EngineFacts, ...], changed: Mapping[str, EngineFacts]) -> "Derived":
        """Derived data of ``engines``: these engines, with ``changed`` (by name) new."""
        new = Derived()
        new.engines = engines
        new.by_name = {**self.by_name, **changed}
        tpot = any((f.tpot_a, f.tpot_b, f.tpot_known) != (o.tpot_a, o.tpot_b, o.tpot_known)
                   for n, f in changed.items() if (o := self.by_name.get(n)) is not None)
        new.cold = cold_tpot(engines) if tpot else self.cold
        new.order, new.window = None, (math.inf, -math.inf)
        if self.order is not None:
            # the same engines in the order: the window narrows to what the changed ones allow
            # (an engine refreshed may widen it: the order is made again when ``now`` leaves it)
            order, (lo, hi) = self.order, self.window
            new.order = order.updated({n: f for n, f in changed.items() if n in order})
            new.window = (max([lo] + [f.eligible_until for n, f in changed.items() if n not in order]),
                          min([hi] + [f.eligible_until for n, f in changed.items() if n in order]))
        new.holders, new._place = {}, self._place
        # (the same engines: only the changed ones' sets are new)
        new.prefix_of = None if self.prefix_of is None else {**self.prefix_of, **{n: f.prefix for n, f in changed.items()}}
        new.before = ((self.holders, changed),) + self.before[:HOLDERS_BEFORE - 1]
        return new

    def known(self, block: int) -> frozenset[str] | None:
        """The holders of ``block`` as remembered here or in the views before (corrected by the
        changes since); None when none remembers."""
        held = self.holders.get(block)
        if held is None:
            for i, (holders, _) in enumerate(self.before):
                if (was := holders.get(block)) is not None:
                    for j in range(i, -1, -1):  # the changes since, the oldest first
                        was = holding_with(was, self.before[j][1], block)
                    held = self._remember(block, was)
                    break
        return held

    def _remember(self, block: int, held: frozenset[str]) -> frozenset[str]:
        if len(self.holders) >= HOLDERS_MEMO:
            self.holders.clear()
        self.holders[block] = held
        return held

    def holding(self, block: int) -> frozenset[str]:
        held = self.known(block)
        if held is None:
            held = self._remember(block, frozenset([n for n, p in self.prefixes().items() if block in p]))
        return held


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


def holding_with(held: frozenset[str], changed: Mapping[str, EngineFacts], block: int) -> frozenset[str]:
    """``held`` (the holders of ``block`` among some engines' facts) with ``changed`` engines' new
    facts in place of theirs."""
    return (held - changed.keys()) | {n for n, f in changed.items() if block in f.prefix}


def cold_tpot(engines: tuple[EngineFacts, ...]) -> tuple[float, float] | None:
    known = [(f.tpot_a, f.tpot_b) for f in engines if f.tpot_known]
    return min(known, key=lambda ab: tpot_at(ab[0], ab[1], 1.0)) if known else None


HOLDERS_MEMO = 4096  # blocks whose holders a view remembers
HOLDERS_BEFORE = 8  # views before whose memos a view reads through (each with its changes since)
HOLDERS_SCAN = 64  # fewer candidate holders than this are looked at directly (no fleet-wide look)
