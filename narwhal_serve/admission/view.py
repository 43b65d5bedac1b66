"""What an admission decision is made on and what it returns (:mod:`.core` decides): one engine's
facts, a holder's own changes since its view was taken, the fleet view, the request's ask and the
placement of an admitted request.  Frozen: views cross the Ray hop in lease grants."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields, replace

from narwhal_serve.admission.retry import Reservation
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.order import RouteOrder
from narwhal_serve.placement.prefix import SetUnion
from narwhal_serve.prediction.decode import DEFAULT_OUTPUT_PRIOR, PRIOR_TPOT_A, tpot_at
from narwhal_serve.protocol.placement import RouteChoice


@dataclass(frozen=True)
class EngineFacts:
    """What a decision needs to know about one engine (a frozen copy of the scheduler's state)."""

    cfg: EngineConfig
    eligible_until: float  # eligible (healthy, fresh metrics, not in maintenance) until this time; 0 = not
    inflight: int  # requests routed here and not seen end
    load: EngineLoad  # last scrape
    pending_prefill_tokens: int  # prompt tokens routed here and not yet past their first token
    ttft_a: float
    ttft_b: float
    slots: int | None
    service_s: float | None
    external: int = 0  # requests from other clients, as last scraped (EngineState.external)
    pending_prefill_requests: int = 0  # requests routed here and not yet past their first token
    ttft_c: float = 0.0  # seconds per request ahead
    tpot_a: float = PRIOR_TPOT_A  # TPOT model: a + b · batch (prediction/decode.py)
    tpot_b: float = 0.0
    tpot_known: bool = False  # the TPOT model has measurements (no TPOT judgement before)
    decode_tokens: float = 0.0  # decode tokens still ahead of the router's requests here (corrected as they run)
    penalty: float = 0.0  # drift: the placement cost is multiplied by 1 + penalty
    prefix: AbstractSet[int] = frozenset()  # prompt-prefix blocks the engine is believed to hold
    ttft_margin: float = 0.0  # a projection here is judged with this relative margin (prediction/ttft.py)
    prefix_credit: float = 1.0  # share of a prefix match credited as cached (measured hit rate)
    cache_block_tokens: int = 0  # the engine reuses its cache in blocks of this many tokens (0: unknown)
    node: str | None = None  # the Ray node a managed engine runs on (None: unknown, an engine by URL)

    def eligible(self, now: float) -> bool:
        return now <= self.eligible_until

    def row(self) -> "FactsRow":
        """These facts as plain values, without the engine's config and prefix set (what a grant's
        delta carries: a tuple pickles at a tenth of a dataclass's cost, and the lease has the
        config and, unless it changed, the set)."""
        d = self.__dict__
        load = self.load
        return tuple([(load.running, load.waiting, load.kv_usage, load.kv_tokens) if k == "load" else d[k]
                      for k in _ROW])

    @staticmethod
    def from_row(cfg: EngineConfig, row: "FactsRow", prefix: AbstractSet[int]) -> "EngineFacts":
        """The facts :meth:`row` made, with the engine's config and prefix set."""
        out = object.__new__(EngineFacts)
        d = out.__dict__
        d.update(zip(_ROW, row))
        d["load"] = EngineLoad(*d["load"])
        d["cfg"], d["prefix"] = cfg, prefix
        return out

    def in_flight(self) -> int:
        """Requests at the engine now: the router's own (exact), plus others' as last scraped."""
        return self.inflight + self.external

    def plus(self, d: "EngineDelta") -> "EngineFacts":
        """These facts with a holder's own changes since they were taken."""
        return replace(
            self,
            inflight=max(0, self.inflight + d.inflight),
            pending_prefill_tokens=max(0, self.pending_prefill_tokens + d.pending_prefill_tokens),
            pending_prefill_requests=max(0, self.pending_prefill_requests + d.pending_prefill_requests),
            decode_tokens=max(0.0, self.decode_tokens + d.decode_tokens),
            prefix=SetUnion(self.prefix, d.prefix) if d.prefix else self.prefix,  # no copy per admission
        )


_ROW = tuple(f.name for f in fields(EngineFacts) if f.name not in ("cfg", "prefix"))
FactsRow = tuple[object, ...]  # EngineFacts.row
# A grant's changed engine: its name, its config where the lease does not hold that one (else
# None), its facts' row
ChangedRow = tuple[str, EngineConfig | None, FactsRow]
# A grant's changed prefix set: the set whole, or the blocks added to and removed from the set the
# lease holds (``prefix_change``; ``with_prefix_change`` makes it whole again)
PrefixChange = AbstractSet[int] | tuple[frozenset[int], frozenset[int]]


def prefix_change(held: AbstractSet[int] | None, new: AbstractSet[int]) -> PrefixChange:
    """What a lease holding ``held`` (None: no set) needs to hold ``new``: the blocks added and
    removed when those are fewer than half of ``new`` (a request's blocks stored, the oldest
    evicted: tens of a thousand; a 10 KB set pickled costs about 55 µs each side, its change and
    the set made again on the other side about a quarter of that), else ``new`` itself."""
    if held is None or not new:
        return new
    added = frozenset(new).difference(held)
    if 2 * len(added) >= len(new):
        return new
    removed = frozenset(held).difference(new)
    return (added, removed) if 2 * (len(added) + len(removed)) < len(new) else new


def with_prefix_change(held: AbstractSet[int], change: PrefixChange) -> AbstractSet[int]:
    """The set a lease holds after ``change`` (:func:`prefix_change`) to ``held``."""
    if not isinstance(change, tuple):
        return change
    added, removed = change
    return frozenset(held).difference(removed).union(added)


@dataclass(frozen=True)
class EngineDelta:
    inflight: int = 0
    pending_prefill_tokens: int = 0
    pending_prefill_requests: int = 0
    decode_tokens: float = 0.0
    prefix: frozenset[int] = frozenset()  # blocks placed here (added; the scheduler's index evicts)
    # blocks whose prefill finished here: the scheduler's index stops counting them as pending (a
    # view keeps them: the engine holds them now)
    prefix_done: frozenset[int] = frozenset()

    def nothing(self) -> bool:
        """No change: an engine's admissions since the view all ended (a prefix placed stays)."""
        return not (self.inflight or self.pending_prefill_tokens or self.pending_prefill_requests
                    or self.decode_tokens or self.prefix)

    def __add__(self, other: "EngineDelta") -> "EngineDelta":
        return EngineDelta(
            self.inflight + other.inflight,
            self.pending_prefill_tokens + other.pending_prefill_tokens,
            self.pending_prefill_requests + other.pending_prefill_requests,
            self.decode_tokens + other.decode_tokens,
            self.prefix | other.prefix if other.prefix else self.prefix,
            self.prefix_done | other.prefix_done if other.prefix_done else self.prefix_done,
        )


class _Derived:
    """What a view's decisions share, made on first use: the engines by name, the route order of
    the engines eligible (and the time window it holds for), which engines hold a block.  A view
    merged from a grant's changes takes its predecessor's, updated for the engines changed
    (:meth:`evolved`), at the cost of those.  A view's receiver makes its own: it is not sent over
    the Ray hop."""

    __slots__ = ("engines", "by_name", "cold", "order", "window", "holders", "before", "_place", "sets", "prefix_of")

    def __init__(self) -> None:
        self.engines: tuple[EngineFacts, ...] | None = None

    def __reduce__(self) -> tuple[type["_Derived"], tuple[()]]:
        return (_Derived, ())

    def of(self, engines: tuple[EngineFacts, ...]) -> "_Derived":
        if self.engines is not engines:
            self.engines = engines
            self.by_name: dict[str, EngineFacts] = {e.cfg.name: e for e in engines}
            self.cold = _cold(engines)
            self.order: RouteOrder[EngineFacts] | None = None
            self.window = (math.inf, -math.inf)
            self.holders: dict[int, frozenset[str]] = {}
            # the views before's holders, each with the engines changed after it (read through,
            # corrected), the latest first; at most HOLDERS_BEFORE
            self.before: tuple[tuple[dict[int, frozenset[str]], Mapping[str, EngineFacts]], ...] = ()
            self._place: dict[str, int] | None = None
            self.sets: list[tuple[str, AbstractSet[int]]] | None = None  # names and prefix sets, for scans
            self.prefix_of: dict[str, AbstractSet[int]] | None = None  # each engine's prefix set by name
        return self

    def prefixes(self) -> dict[str, AbstractSet[int]]:
        """Each engine's prefix set by name (a scan of some engines reads one dict, no attributes)."""
        if self.prefix_of is None:
            self.prefix_of = {name: f.prefix for name, f in self.by_name.items()}
        return self.prefix_of

    def place(self) -> dict[str, int]:
        """Each engine's place in the fleet's order."""
        if self._place is None:
            assert self.engines is not None
            self._place = {e.cfg.name: i for i, e in enumerate(self.engines)}
        return self._place

    def evolved(self, engines: tuple[EngineFacts, ...], changed: Mapping[str, EngineFacts]) -> "_Derived":
        """Derived data of ``engines``: these engines, with ``changed`` (by name) new."""
        new = _Derived()
        new.engines = engines
        new.by_name = {**self.by_name, **changed}
        tpot = any((f.tpot_a, f.tpot_b, f.tpot_known) != (o.tpot_a, o.tpot_b, o.tpot_known)
                   for n, f in changed.items() if (o := self.by_name.get(n)) is not None)
        new.cold = _cold(engines) if tpot else self.cold
        new.order, new.window = None, (math.inf, -math.inf)
        if self.order is not None:
            # the same engines in the order: the window narrows to what the changed ones allow
            # (an engine refreshed may widen it: the order is made again when ``now`` leaves it)
            order, (lo, hi) = self.order, self.window
            new.order = order.updated({n: f for n, f in changed.items() if n in order})
            new.window = (max([lo] + [f.eligible_until for n, f in changed.items() if n not in order]),
                          min([hi] + [f.eligible_until for n, f in changed.items() if n in order]))
        new.holders, new._place, new.sets = {}, self._place, None
        new.prefix_of = None if self.prefix_of is None else {**self.prefix_of, **{n: f.prefix for n, f in changed.items()}}
        if self.sets is not None:  # the same engines in the same places: only the changed ones' sets are new
            place = self.place()
            new._place, new.sets = place, list(self.sets)
            for name, f in changed.items():
                new.sets[place[name]] = (name, f.prefix)
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
                        was = _holding_with(was, self.before[j][1], block)
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
            if self.sets is None:  # (names and sets side by side: a scan reads no attributes)
                assert self.engines is not None
                self.sets = [(e.cfg.name, e.prefix) for e in self.engines]
            held = self._remember(block, frozenset([n for n, p in self.sets if block in p]))
        return held


class _Facts(Mapping[str, EngineFacts]):
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


def _holding_with(held: frozenset[str], changed: Mapping[str, EngineFacts], block: int) -> frozenset[str]:
    """``held`` (the holders of ``block`` among some engines' facts) with ``changed`` engines' new
    facts in place of theirs."""
    return (held - changed.keys()) | {n for n, f in changed.items() if block in f.prefix}


def _cold(engines: tuple[EngineFacts, ...]) -> tuple[float, float] | None:
    known = [(f.tpot_a, f.tpot_b) for f in engines if f.tpot_known]
    return min(known, key=lambda ab: tpot_at(ab[0], ab[1], 1.0)) if known else None


HOLDERS_MEMO = 4096  # blocks whose holders a view remembers
HOLDERS_BEFORE = 8  # views before whose memos a view reads through (each with its changes since)
HOLDERS_SCAN = 64  # fewer candidate holders than this are looked at directly (no fleet-wide look)


@dataclass(frozen=True)
class FleetView:
    """The engines as taken (``engines``: by the scheduler, in its clock), plus a holder's own
    changes since (``changed``: those engines' facts as they are now), in the holder's clock
    (``shift``: seconds to add to the scheduler's times).  Decisions read it through
    :meth:`facts` and :meth:`order`, which cost the engines changed, not the fleet."""

    engines: tuple[EngineFacts, ...]
    unavailable: str | None  # the router-state reason it refuses everything, or None
    predictive: bool
    queued_tokens: int = 0  # prompt tokens waiting in the scheduler's queue
    queued: int = 0  # requests waiting in the scheduler's queue
    epoch: int = 0  # the router lease's fencing token (0: no lease backend), sent to engines
    outputs: tuple[tuple[str, int, float], ...] = ()  # learned output lengths (OutputLengths.table)
    output_prior: float = DEFAULT_OUTPUT_PRIOR
    reservations: tuple[Reservation, ...] = ()  # room kept for refused clients' retries (admission/retry.py)
    streams_end_at: float | None = None  # draining: wall time the ingress ends the streams still open
    over_share: frozenset[str] = frozenset()  # tenants over their fair share (tenants/fair.py)
    changed: Mapping[str, EngineFacts] = field(default_factory=dict)
    shift: float = 0.0
    _derived: _Derived = field(default_factory=_Derived, compare=False, repr=False)

    def _d(self) -> _Derived:
        return self._derived.of(self.engines)

    def facts(self) -> Mapping[str, EngineFacts]:
        """Every engine's facts by name, the holder's changes in."""
        by_name = self._d().by_name
        return _Facts(self.changed, by_name) if self.changed else by_name

    def current(self) -> tuple[EngineFacts, ...]:
        """Every engine's facts, the holder's changes in (the fleet's order)."""
        if not self.changed:
            return self.engines
        return tuple(self.changed.get(e.cfg.name, e) for e in self.engines)

    def eligible(self, now: float) -> list[EngineFacts]:
        """The engines eligible at ``now`` (the holder's clock)."""
        t = now - self.shift
        return [e for e in self.current() if e.eligible(t)]

    def order(self, now: float) -> RouteOrder[EngineFacts]:
        """The routes over the engines eligible at ``now``, sorted once per view (and again only when
        ``now`` passes an engine's eligibility); the holder's changes are scored per decision."""
        d, t = self._d(), now - self.shift
        lo, hi = d.window
        if d.order is None or not lo < t <= hi:
            eligible = [e for e in self.engines if e.eligible(t)]
            d.order = RouteOrder(eligible)
            d.window = (max((e.eligible_until for e in self.engines if not e.eligible(t)), default=-math.inf),
                        min((e.eligible_until for e in eligible), default=math.inf))
        return d.order

    def holding(self, block: int) -> frozenset[str]:
        """The engines believed to hold ``block`` (placement/prefix.py), the holder's changes in."""
        held = self._d().holding(block)
        return _holding_with(held, self.changed, block) if self.changed else held

    def deepest(self, prefix: tuple[int, ...]) -> frozenset[str]:
        """The engines holding the deepest of ``prefix``'s blocks that any engine holds; empty when
        none holds its first.  Found by halving the depth, among the holders found so far (an
        engine holding a block holds the ones before it, as caches fill and evict prefixes from
        their ends): a few looks at the engines that matter, not the fleet."""
        held = self.holding(prefix[0]) if prefix else frozenset()
        lo, hi = 0, len(prefix) - 1  # prefix[lo] is held by every engine in ``held``
        while held and lo < hi:
            mid = (lo + hi + 1) // 2
            b = prefix[mid]
            deeper = self._among(b, held)
            if deeper:
                lo, held = mid, deeper
            else:
                hi = mid - 1
        return held

    def _among(self, block: int, held: frozenset[str]) -> frozenset[str]:
        """The engines of ``held`` holding ``block``: from the holders remembered; else, with
        ``held`` most of the fleet, from a look at the fleet (remembered for the next decision);
        else from a look at ``held`` alone."""
        d = self._d()
        if len(held) > HOLDERS_SCAN:
            known = d.known(block)
            if known is not None or 2 * len(held) > len(self.engines):
                return self.holding(block) & held
        prefix = d.prefixes()
        out = {n for n in held if block in prefix[n]}
        for n, f in self.changed.items():  # the holder's own changes
            if n in held:
                if block in f.prefix:
                    out.add(n)
                else:
                    out.discard(n)
        return frozenset(out)

    def cold_tpot(self) -> tuple[float, float] | None:
        """The best measured TPOT model (what an engine with none yet is ranked with)."""
        return self._d().cold

    def merged(self, delta: "FleetView", names: tuple[str, ...],
               prefixes: Mapping[str, PrefixChange] | None = None,
               rows: Sequence[ChangedRow] = ()) -> "FleetView | None":
        """The view ``delta`` (the engines changed since this one) whole again: its engines with
        this one's for the rest, in the order of ``names`` (empty: this view's).  The changed
        engines are ``delta``'s own (whole facts), or, in a grant, ``rows``: each keeps this
        view's config unless its row has one, and its prefix set unless ``prefixes`` has a change
        of it (:func:`prefix_change`).
        Decisions keep this view's route order, with the engines changed re-sorted.  None when
        an engine is in neither (not a delta of this view)."""
        d = self._d()
        changed: dict[str, EngineFacts] = {e.cfg.name: e for e in delta.engines}
        sets = prefixes or {}
        for name, cfg, row in rows:
            old = d.by_name.get(name)
            if cfg is None:
                if old is None:
                    return None
                cfg = old.cfg
            held = old.prefix if old is not None else frozenset()
            change = sets.get(name)
            changed[name] = EngineFacts.from_row(cfg, row, held if change is None else with_prefix_change(held, change))
        if names:  # the fleet changed: everything is derived anew
            if any(n not in changed and n not in d.by_name for n in names):
                return None
            engines = tuple(changed.get(n) or d.by_name[n] for n in names)
            return replace(delta, engines=engines, changed={}, shift=0.0, _derived=_Derived())
        listed = list(self.engines)
        place = d.place()
        if any(name not in place for name in changed):
            return None
        for name, f in changed.items():
            listed[place[name]] = f
        engines = tuple(listed)
        return replace(delta, engines=engines, changed={}, shift=0.0, _derived=d.evolved(engines, changed))

    def shifted(self, dt: float) -> "FleetView":
        """The view with its times moved by ``dt`` (into another process's clock)."""
        return replace(self, shift=self.shift + dt)


@dataclass(frozen=True)
class Ask:
    prompt_tokens: int
    ttft_budget_s: float
    tpot_budget_s: float | None = None  # None: no TPOT judgement
    kind: str = "chat"  # route kind: output lengths are learned per kind
    max_output_tokens: int | None = None
    prefix: tuple[int, ...] = ()  # the prompt's block hashes (placement/prefix.py)
    prefix_block_tokens: float = 0.0  # prompt tokens one block stands for
    retry: bool = False  # a client's retry (it may use the room reserved for retries)
    reserves: bool = False  # the client retries after Retry-After: a TTFT refusal reserves room
    tenant: str = ""  # whose budget it is charged to (tenants/: "" the anonymous tenant)
    fingerprint: str = ""  # a retrying client's body hash: its budget promise is found again by it
    rank: int = 0  # its priority class (0: the top class): queued requests leave in rank order
    # admitted only while its projected TTFT is within this (a lower class's headroom for the ones
    # above: admission.classes ttft_share × the top class's target); None: its own target
    admit_within_s: float | None = None
    node: str | None = None  # the Ray node of the ingress it arrived at: engines there win near-ties


@dataclass(frozen=True)
class Placement:
    """An admitted request's ranked routes, and the numbers its admission was judged on."""

    routes: tuple[RouteChoice, ...]
    first_engine: str | None  # the engine whose prefill gives the first token on routes[0]
    prompt_tokens: int
    x_tokens: int  # prefill tokens at that engine, this prompt included
    slot_wait_s: float  # the queueing part of the prediction
    predicted_s: float | None
    r_ahead: int = 0  # requests waiting for prefill at that engine, ahead of this one
    ttft_budget_s: float | None = None  # the request's TTFT target (goodput: first token within it)
    kind: str = "chat"
    max_output_tokens: int | None = None
    expected_out: float = 0.0  # expected output tokens (learned), charged to the decode engine
    decode_engine: str | None = None  # the engine that decodes on routes[0]
    batch: float = 1.0  # sequences the decode engine runs with this one (the TPOT model's x)
    predicted_tpot_s: float | None = None
    cached_tokens: int = 0  # prompt tokens credited as held by the first-token engine (prefix)
    matched_tokens: int = 0  # the prefix match those were credited from (learning: hit or miss)
    prefix: tuple[int, ...] = field(default=(), repr=False)
    tpot_budget_s: float | None = None
    tenant: str = ""
    rank: int = 0  # its priority class

    @property
    def engines(self) -> tuple[str, ...]:
        return self.routes[0].engines if self.routes else ()

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens its first-token engine has to prefill (the cached prefix not counted)."""
        return self.prompt_tokens - self.cached_tokens
