"""What an admission decision is made on and what it returns (:mod:`.core` decides): the fleet
view (one engine's facts: :mod:`.facts`; what a view derives for decisions: :mod:`.derived`), the
request's ask and the placement of an admitted request.  Frozen: views cross the Ray hop in lease
grants."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from narwhal_serve.admission.derived import Derived, FactsOver, FleetContext, holding_with
from narwhal_serve.admission.facts import ChangedRow, EngineFacts, PrefixChange, with_prefix_change
from narwhal_serve.admission.retry import Reservation
from narwhal_serve.placement.order import RouteOrder
from narwhal_serve.prediction.decode import DEFAULT_OUTPUT_PRIOR
from narwhal_serve.prediction.ttft import on_idle_engine
from narwhal_serve.protocol.placement import RouteChoice


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
    # engines whose circuit breaker opened (and is not closed again), with when (the scheduler's
    # clock): an ingress resumes the streams still on them elsewhere (relay/pipeline.py cut_engine)
    tripped: tuple[tuple[str, float], ...] = ()
    changed: Mapping[str, EngineFacts] = field(default_factory=dict)
    shift: float = 0.0
    _derived: Derived = field(default_factory=Derived, compare=False, repr=False)

    def _d(self) -> Derived:
        return self._derived.of(self.engines)

    def facts(self) -> Mapping[str, EngineFacts]:
        """Every engine's facts by name, the holder's changes in."""
        by_name = self._d().by_name
        return FactsOver(self.changed, by_name) if self.changed else by_name

    def taken(self, name: str) -> EngineFacts | None:
        """The engine's facts as the scheduler took them (without this holder's changes since)."""
        return self._d().by_name.get(name)

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
        return holding_with(held, self.changed, block) if self.changed else held

    def deepest(self, prefix: tuple[int, ...]) -> frozenset[str]:
        """The engines holding the deepest of ``prefix``'s blocks that any engine holds; empty when
        none holds its first.  Found by halving the depth, among the holders found so far (an
        engine holding a block holds the ones before it, as caches fill and evict prefixes from
        their ends): a few look-ups in the view's block index, not a look at the fleet."""
        held = self.holding(prefix[0]) if prefix else frozenset()
        lo, hi = 0, len(prefix) - 1  # prefix[lo] is held by every engine in ``held``
        while held and lo < hi:
            mid = (lo + hi + 1) // 2
            deeper = self.holding(prefix[mid]) & held
            if deeper:
                lo, held = mid, deeper
            else:
                hi = mid - 1
        return held

    def context(self) -> FleetContext:
        """The contexts the fleet's engines said (admission/derived.py :class:`FleetContext`): a
        prompt shorter than the shortest fits anywhere; one as long as the longest nowhere, once
        every engine has said its own."""
        return self._d().context()

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
        moves = {}  # the blocks a set lost and gained, where the grant says (the block index's update)
        for name, cfg, row in rows:
            old = d.by_name.get(name)
            if cfg is None:
                if old is None:
                    return None
                cfg = old.cfg
            held = old.prefix if old is not None else frozenset()
            change = sets.get(name)
            if isinstance(change, tuple):
                moves[name] = (change[1], change[0])
            changed[name] = EngineFacts.from_row(cfg, row, held if change is None else with_prefix_change(held, change))
        if names:  # the fleet changed: everything is derived anew
            if any(n not in changed and n not in d.by_name for n in names):
                return None
            engines = tuple(changed.get(n) or d.by_name[n] for n in names)
            return replace(delta, engines=engines, changed={}, shift=0.0, _derived=Derived())
        listed = list(self.engines)
        place = d.place()
        if any(name not in place for name in changed):
            return None
        for name, f in changed.items():
            listed[place[name]] = f
        engines = tuple(listed)
        return replace(delta, engines=engines, changed={}, shift=0.0, _derived=d.evolved(engines, changed, moves))

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
    min_output_tokens: int = 0  # its output is expected to be at least this (ignore_eos, min_tokens)
    exact: bool = False  # ``prompt_tokens`` is the engine's own count (the router's tokenizer, or token IDs)
    output_param: str = "max_tokens"  # the field ``max_output_tokens`` came from (its refusal names it)
    truncate_to: int = 0  # ``truncate_prompt_tokens`` N >= 1: the engine keeps at most N (a context shorter refuses it)
    # how long ago it reached the router (HAProxy's stamp, else its handler's start) when asked: its
    # projected TTFT is judged against the budget less this (the prompt alone against the whole budget)
    waited_s: float = 0.0


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
    # prompt tokens of the head of the line at that engine counted as prefilled already (x is net
    # of them; an estimate from when the head started: such a request does not teach the model)
    head_done: int = 0
    decoding: int = 0  # requests decoding at its decode engine when its prefill runs

    @property
    def engines(self) -> tuple[str, ...]:
        return self.routes[0].engines if self.routes else ()

    @property
    def idle(self) -> bool:
        """Placed on an idle route: no prompt ahead of its own, none decoding, no slot wait."""
        return on_idle_engine(self.x_tokens - self.prefill_tokens, self.r_ahead, self.decoding, self.slot_wait_s)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens its first-token engine has to prefill (the cached prefix not counted)."""
        return self.prompt_tokens - self.cached_tokens
