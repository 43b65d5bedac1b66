"""The engines' facts as granted to admission leases, and read by the scheduler's own decisions and
``/ready`` (docs/architecture.md, "Admission leases"): per engine the inputs its facts were made
of and the facts, each change numbered (a lease is sent the engines changed since the number it
holds), read again when the engine is touched and every engine at least each FULL_VIEW_S.  What an
engine's inputs are, read from its live state, is the scheduler's (``state.py`` ``_inputs``)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Set as AbstractSet
from dataclasses import replace

from narwhal_serve.admission.core import EngineFacts, FleetView
from narwhal_serve.admission.facts import FACT_FIELDS, ChangedRow, FactsRow, PrefixChange, facts_from, prefix_change
from narwhal_serve.scheduler.leases import LEASE_TTL_S, Held

# the facts granted to leases are read for every engine at least this often (else only for the engines
# touched: their tickets, reports, KV changes); what changes with time alone (a breaker's open
# period ending) or without a touch (the fleet's TTFT prior) reaches the leases within it
FULL_VIEW_S = 0.25
# An eligible engine's granted ``eligible_until`` (its last answer plus monitoring.stale_after_s)
# is kept while it is still at least this far ahead: every answered scrape moves it, and read anew
# each time it made a third of the rows grants carried at 1,000 engines. A view is used at most
# LEASE_TTL_S after its grant, whose untouched engines were read at most FULL_VIEW_S before it, so
# a time kept this far ahead at a read is still ahead whenever a view holding it is used: no
# decision changes (docs/architecture.md, "Admission leases"). CLOCK_STEP_S more for an ingress
# whose wall clock steps forward while its lease (on its monotonic clock) holds: a step up to that
# turns no kept engine stale early (an exact time, with the default scrapes and stale_after_s,
# tolerated about 1.75 s)
CLOCK_STEP_S = 1.0
KEEP_ELIGIBLE_S = LEASE_TTL_S + FULL_VIEW_S + CLOCK_STEP_S

# the fields of an engine's facts, in the order of their inputs (SchedulerState._inputs)
INPUT_FIELDS = ("eligible_until", "inflight", "load", "pending_prefill_tokens", "ttft_a", "ttft_b", "slots",
                "service_s", "external", "pending_prefill_requests", "ttft_c", "tpot_a", "tpot_b", "tpot_known",
                "decode_tokens", "penalty", "ttft_margin", "ttft_idle_margin", "prefix_credit", "cache_block_tokens",
                "node", "releases", "line_since", "line_head_tokens", "context", "prefix", "cfg")
assert len(INPUT_FIELDS) == len(FACT_FIELDS) and set(INPUT_FIELDS) == FACT_FIELDS, set(INPUT_FIELDS) ^ FACT_FIELDS
RELEASES = INPUT_FIELDS.index("releases")  # the slot releases' place in the inputs

Inputs = tuple[object, ...]


def facts(inputs: Inputs) -> EngineFacts:
    """An engine's facts from their inputs (in INPUT_FIELDS' order)."""
    return facts_from(INPUT_FIELDS, inputs)


def kept_eligible(inputs: Inputs, kept: Inputs, now: float) -> Inputs:
    """An engine's facts' inputs read ``now``, with the eligibility time of those granted before
    (``kept``) kept while both are eligible and it is still KEEP_ELIGIBLE_S ahead (the new one is
    later still)."""
    eu, was = inputs[0], kept[0]
    if eu != was and isinstance(eu, float) and isinstance(was, float) and 0.0 < was <= eu \
            and was >= now + KEEP_ELIGIBLE_S:
        return (was, *inputs[1:])
    return inputs


def same_but_releases(a: Inputs, b: Inputs) -> bool:
    """Equal but for their slot releases (times that move as time passes: a running request's
    decode runs on, a free slot or another client's request is counted from the read)."""
    return a[:RELEASES] + a[RELEASES + 1:] == b[:RELEASES] + b[RELEASES + 1:]


class GrantedFacts:
    """Per engine the inputs and facts last granted, the number of its last change (in order: the
    most recent last), the fleet's change count and membership count; the engines touched since the
    last read, and when every engine was last read."""

    def __init__(self) -> None:
        self.by_name: dict[str, tuple[Inputs, EngineFacts]] = {}
        self._changed_at: OrderedDict[str, int] = OrderedDict()
        self._rows: dict[str, tuple[EngineFacts, FactsRow]] = {}  # granted facts, and them as a row
        # the last prefix change granted per engine (the set a lease held, the set granted, the
        # change): the next lease holding the same set gets the same change, not computed again
        self._prefix_changes: dict[str, tuple[AbstractSet[int] | None, AbstractSet[int], PrefixChange]] = {}
        self.seq = 0  # the change number of the last change
        self.members = 0  # the fleet's membership changes
        self.touched: set[str] = set()
        self.full_at = -math.inf  # when every engine was last read (-inf: read them all next)
        # the last decision view: the membership it was made in, it, the change number it is up to
        self._decided: tuple[int, FleetView, int] | None = None

    def take_touched(self, names: AbstractSet[str]) -> list[str]:
        """The engines touched since the last call that are still in the fleet ``names``."""
        touched = [n for n in self.touched if n in names]
        self.touched = set()
        return touched

    def full_due(self, now: float, engines: int) -> bool:
        return not 0.0 <= now - self.full_at < FULL_VIEW_S or len(self.by_name) != engines  # (or the clock stepped back)

    def members_now(self, names: Collection[str]) -> None:
        """The fleet is ``names`` (in order; a dict, for membership tests at once): an engine
        removed is forgotten, and a change of the membership or its order (an engine gone and back
        is in a new place) counted."""
        if list(self.by_name) == list(names):
            return
        self.members += 1
        for name in [n for n in self.by_name if n not in names]:  # removed by a reload
            del self.by_name[name]
            self._changed_at.pop(name, None)
            self._rows.pop(name, None)
            self._prefix_changes.pop(name, None)
        self.by_name = {n: self.by_name[n] for n in names if n in self.by_name}

    def put(self, name: str, inputs: Inputs, now: float) -> None:
        """Engine ``name``'s inputs as read ``now``: its facts keep their object while unchanged
        (their eligibility time kept, kept_eligible); new ones get the next change number."""
        kept = self.by_name.get(name)
        if kept is not None and (inputs := kept_eligible(inputs, kept[0], now)) == kept[0]:
            return
        self.by_name[name] = (inputs, facts(inputs))
        self.seq += 1
        self._changed_at[name] = self.seq
        self._changed_at.move_to_end(name)

    def all(self, names: Iterable[str]) -> list[EngineFacts]:
        return [self.by_name[n][1] for n in names]

    def since(self, seq: int) -> list[EngineFacts]:
        """The engines whose facts changed after change number ``seq`` (O(changed))."""
        return [self.by_name[name][1] for name in self._changed_since(seq)]

    def _changed_since(self, seq: int) -> Iterator[str]:
        for name, at in reversed(self._changed_at.items()):
            if at <= seq:
                return
            yield name

    def decision_view(self, fresh: FleetView, names: Iterable[str]) -> FleetView:
        """``fresh`` (the router's state, no engines) with the granted facts of the fleet ``names``:
        the last such view with the engines changed since (FleetView.merged), so what decisions
        derive from a view (its route order, its block index) is kept and updated."""
        view, kept = None, self._decided
        if kept is not None and kept[0] == self.members:
            view = kept[1].merged(replace(fresh, engines=tuple(self.since(kept[2]))), ())
        if view is None:
            view = replace(fresh, engines=tuple(self.all(names)))
        self._decided = (self.members, view, self.seq)
        return view

    def delta(self, since: int, held: dict[str, Held]) -> tuple[dict[str, PrefixChange], list[ChangedRow]]:
        """For a lease holding the facts up to change number ``since`` and, by engine, the configs
        and prefix sets ``held`` (updated to what it will hold): the engines changed since as rows
        (EngineFacts.row) with their configs where it does not hold those, and the changes of the
        prefix sets that are not the ones it holds (facts.prefix_change)."""
        prefixes: dict[str, PrefixChange] = {}
        rows: list[ChangedRow] = []
        for name in self._changed_since(since):
            f = self.by_name[name][1]
            kept = held.get(name)
            if kept is None or kept[1] is not f.prefix:
                was = None if kept is None else kept[1]
                c = self._prefix_changes.get(name)
                if c is None or c[0] is not was or c[1] is not f.prefix:
                    c = self._prefix_changes[name] = (was, f.prefix, prefix_change(was, f.prefix))
                prefixes[name] = c[2]
            held[name] = (f.cfg, f.prefix)
            b = self._rows.get(name)
            if b is None or b[0] is not f:
                b = self._rows[name] = (f, f.row())
            rows.append((name, None if kept is not None and kept[0] is f.cfg else f.cfg, b[1]))
        return prefixes, rows
