"""What an admission decision is made on and what it returns (:mod:`.core` decides): one engine's
facts, a holder's own changes since its view was taken, the fleet view, the request's ask and the
placement of an admitted request.  Frozen: views cross the Ray hop in lease grants."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

from narwhal_serve.admission.retry import Reservation
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import EngineLoad
from narwhal_serve.placement.prefix import SetUnion
from narwhal_serve.prediction.decode import DEFAULT_OUTPUT_PRIOR, PRIOR_TPOT_A
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

    def in_flight(self) -> int:
        """Requests at the engine now: the router's own (exact), plus others' as last scraped."""
        return self.inflight + self.external


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

    def __add__(self, other: "EngineDelta") -> "EngineDelta":
        return EngineDelta(
            self.inflight + other.inflight,
            self.pending_prefill_tokens + other.pending_prefill_tokens,
            self.pending_prefill_requests + other.pending_prefill_requests,
            self.decode_tokens + other.decode_tokens,
            self.prefix | other.prefix if other.prefix else self.prefix,
            self.prefix_done | other.prefix_done if other.prefix_done else self.prefix_done,
        )


@dataclass(frozen=True)
class FleetView:
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

    def adjusted(self, deltas: Mapping[str, EngineDelta]) -> "FleetView":
        """This view with a holder's own changes since it was taken."""
        if not deltas:
            return self
        engines = tuple(
            replace(
                e,
                inflight=max(0, e.inflight + d.inflight),
                pending_prefill_tokens=max(0, e.pending_prefill_tokens + d.pending_prefill_tokens),
                pending_prefill_requests=max(0, e.pending_prefill_requests + d.pending_prefill_requests),
                decode_tokens=max(0.0, e.decode_tokens + d.decode_tokens),
                prefix=SetUnion(e.prefix, d.prefix) if d.prefix else e.prefix,  # no copy per admission
            )
            if (d := deltas.get(e.cfg.name)) is not None
            else e
            for e in self.engines
        )
        return replace(self, engines=engines)

    def shifted(self, dt: float) -> "FleetView":
        """The view with its times moved by ``dt`` (into another process's clock)."""
        return replace(self, engines=tuple(replace(e, eligible_until=e.eligible_until + dt) for e in self.engines))


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
