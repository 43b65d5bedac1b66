"""One engine's facts as an admission decision reads them, and how they cross the Ray hop in a
lease grant: as a row of plain values (:meth:`EngineFacts.row`), with the engine's prefix set sent
only when it changed, as its change where that is small (:func:`prefix_change`); and a holder's own
changes to an engine since its view was taken (:class:`EngineDelta`)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Set as AbstractSet
from dataclasses import dataclass, fields
from typing import TypeVar

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.prefix import SetUnion
from narwhal_serve.prediction.decode import PRIOR_TPOT_A


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
    # the prompt alone, and a projection onto this engine idle, with this one (None: ``ttft_margin``)
    ttft_idle_margin: float | None = None
    prefix_credit: float = 1.0  # share of a prefix match credited as cached (measured hit rate)
    cache_block_tokens: int = 0  # the engine reuses its cache in blocks of this many tokens (0: unknown)
    node: str | None = None  # the Ray node a managed engine runs on (None: unknown, an engine by URL)
    # when a slot frees here for each of the next requests beyond its slots (times on the facts'
    # clock; admission/ledger.py releases); empty: none known (the mean drain applies)
    releases: tuple[float, ...] = ()
    # the prefill at the head of its line of pending prompts: since when it runs (the facts' clock:
    # when the line's head last changed, by the scheduler's ledger) and its prompt tokens; None:
    # no line, or its head not known to the holder (a prefill of its own finished since the view)
    line_since: float | None = None
    line_head_tokens: int = 0
    context: int = 0  # the engine's context length (its /v1/models ``max_model_len``); 0: not known

    def holds(self, prompt_tokens: int) -> bool:
        """Whether a prompt this long leaves room for an output token here (unknown: assumed so)."""
        return not self.context or prompt_tokens < self.context

    def eligible(self, now: float) -> bool:
        return now <= self.eligible_until

    def row(self) -> "FactsRow":
        """These facts as plain values, without the engine's config and prefix set (what a grant's
        delta carries: a tuple pickles at a tenth of a dataclass's cost, and the lease has the
        config and, unless it changed, the set)."""
        load = self.load
        values = _ROW_VALUES(self.__dict__)
        return (*values[:_LOAD_AT], (load.running, load.waiting, load.kv_usage, load.kv_tokens), *values[_LOAD_AT + 1:])

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
        # (for each engine of every admission and release at an ingress lease)
        return copied(
            self,
            inflight=max(0, self.inflight + d.inflight),
            pending_prefill_tokens=max(0, self.pending_prefill_tokens + d.pending_prefill_tokens),
            pending_prefill_requests=max(0, self.pending_prefill_requests + d.pending_prefill_requests),
            decode_tokens=max(0.0, self.decode_tokens + d.decode_tokens),
            prefix=SetUnion(self.prefix, d.prefix) if d.prefix else self.prefix,  # no copy per admission
            line_since=None if d.prefills_done else self.line_since,
        )

    def prefilled_tokens(self, t: float) -> float:
        """Prompt tokens of the head of the pending line counted as prefilled at ``t`` (the facts'
        clock): its first token is due ``a + b`` · its prompt after it started, and what is left of
        that is counted, not less (the time since it started beyond the model's ``a``, at its ``b``;
        at most its prompt); none without a line or a rate.  A request placed behind it waits for
        the rest only.  Where ``a`` dominates (an engine whose short prefills wait for its next
        step) the head counts whole until its ``a`` has passed; so does it while other clients'
        requests wait there (their prompts may be prefilled first)."""
        if self.line_since is None or self.ttft_b <= 0.0 or not self.pending_prefill_tokens \
                or (self.external and self.load.waiting):  # others' prompts waiting there may go first
            return 0.0
        return min(float(self.line_head_tokens), float(self.pending_prefill_tokens),
                   max(0.0, t - self.line_since - self.ttft_a) / self.ttft_b)


_T = TypeVar("_T")


def copied(obj: _T, **changes: object) -> _T:
    """The frozen dataclass ``obj`` with ``changes`` (fields by name): its fields copied, not
    ``dataclasses.replace``, which runs the frozen ``__init__`` (4–7 µs where this takes about 1:
    on a lease's hot path, every admission, release and decision).  For dataclasses without
    ``__post_init__``."""
    assert changes.keys() <= obj.__dict__.keys(), changes.keys() - obj.__dict__.keys()
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__)
    out.__dict__.update(changes)
    return out


def facts_from(names: tuple[str, ...], values: Iterable[object]) -> EngineFacts:
    """The facts whose fields ``names`` (every field, each once) have ``values``: their dict filled,
    not the frozen ``__init__`` (an ``object.__setattr__`` per field, about 5 µs of the ~15 µs a
    scheduler takes to read an engine's facts, for each engine changed).  The caller checks
    ``names`` once (:data:`FACT_FIELDS`)."""
    out = object.__new__(EngineFacts)
    out.__dict__.update(zip(names, values, strict=True))
    return out


FACT_FIELDS = frozenset(f.name for f in fields(EngineFacts))
_ROW = tuple(f.name for f in fields(EngineFacts) if f.name not in ("cfg", "prefix"))
_ROW_VALUES = operator.itemgetter(*_ROW)  # (a row's values read in C)
_LOAD_AT = _ROW.index("load")
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
    prefills_done: int = 0  # prefills finished here (the head of the line may have changed)

    def nothing(self) -> bool:
        """No change: an engine's admissions since the view all ended (a prefix placed stays) and
        no prefill finished there (one that did may have been the head of the line the view knew)."""
        return not (self.inflight or self.pending_prefill_tokens or self.pending_prefill_requests
                    or self.decode_tokens or self.prefix or self.prefills_done)

    def __add__(self, other: "EngineDelta") -> "EngineDelta":
        return EngineDelta(
            self.inflight + other.inflight,
            self.pending_prefill_tokens + other.pending_prefill_tokens,
            self.pending_prefill_requests + other.pending_prefill_requests,
            self.decode_tokens + other.decode_tokens,
            self.prefix | other.prefix if other.prefix else self.prefix,
            self.prefix_done | other.prefix_done if other.prefix_done else self.prefix_done,
            self.prefills_done + other.prefills_done,
        )
