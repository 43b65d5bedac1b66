"""The scheduler's side of passive engine health: failed attempts reported by ingress replicas
feed each engine's breaker (:mod:`narwhal_serve.placement.health`), and an engine whose breaker
has been open its full period gets one probe request of the scheduler's own; an engine whose
drift score took it out of rotation (:mod:`narwhal_serve.placement.drift`) is re-measured with
profiling requests until it behaves as measured again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import httpx

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.placement.engines import EngineState
from narwhal_serve.placement.drift import PROFILE_OUTPUT_TOKENS, PROFILE_PROMPT_CHARS, ProfileErrors, rel_error
from narwhal_serve.placement.health import may_open
from narwhal_serve.prediction.decode import TpotModel
from narwhal_serve.prediction.ttft import ErrorWindow, PrefillModel
from narwhal_serve.relay.messages import EngineWorked, HealthEvent
from narwhal_serve.scheduler.monitor import Profile, probe_one, profile_one

log = logging.getLogger("narwhal.drift")


def _out_of_work(engines: dict[str, EngineState], now: float, maintenance: frozenset[str], but: EngineState) -> int:
    """The engines other than ``but`` (the one being judged: taking it out takes no other) that
    take no work now: breaker open or pushing back, out for drift, down (its health check failing,
    a managed engine's process not up) or in a maintenance wave — a breaker must not take out the
    last engines that can serve because the others are out for another reason."""
    return sum(1 for x in engines.values()
               if x is not but and (not x.breaker.takes_work(now) or x.drift.out or not x.healthy
                                    or x.cfg.wave in maintenance or (x.managed is not None and not x.managed.up)))


def apply_health(engines: dict[str, EngineState], events: Iterable[HealthEvent], now: float,
                 cfg: NarwhalConfig, maintenance: frozenset[str] = frozenset()) -> list[str]:
    """Feed the engines' breakers in the order things happened: a first token resets an engine's
    failures; a failed attempt counts against it, or starts a backpressure window — never taking
    more engines out of work (:func:`_out_of_work`) than the fleet can spare:
    :func:`~narwhal_serve.placement.health.may_open`.  The engines whose breaker these events
    opened (the streams still on them are resumed elsewhere: docs/contract.md, "Mid-stream resume")."""
    tripped: list[str] = []
    for f in events:
        if isinstance(f, EngineWorked):
            for name in f.engines:
                if (e := engines.get(name)) is not None:
                    e.breaker.on_success()
        elif (e := engines.get(f.engine)) is not None:
            spare = may_open(_out_of_work(engines, now, maintenance, e), len(engines), cfg.monitoring)
            was = e.breaker.state
            e.breaker.on_fault(f.kind, now, cfg.monitoring, f.retry_after_s, f.why, may_open=spare)
            if was == "closed" and e.breaker.state == "open":
                tripped.append(f.engine)
    return tripped


class Prober:
    """Probes of engines whose breaker is open: at most one in flight per engine."""

    def __init__(self, cfg: NarwhalConfig, clock: Callable[[], float], on_closed: Callable[[], None]) -> None:
        self.cfg = cfg
        self.clock = clock
        self.on_closed = on_closed  # called when a probe closed a breaker (queued requests may fit)
        self.tasks: set[asyncio.Task[None]] = set()

    def start_due(self, engines: Iterable[EngineState], client: httpx.AsyncClient) -> None:
        now = self.clock()
        for e in engines:
            if e.breaker.probe_due(now):
                task = asyncio.get_running_loop().create_task(self._probe(e, client))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _probe(self, e: EngineState, client: httpx.AsyncClient) -> None:
        timeout = self.cfg.serving.first_token_limit(self.cfg.admission.ttft_budget_s)
        try:
            ok, why = await probe_one(client, e, self.cfg.model, timeout)
        except Exception as exc:  # (a probe that raised is a failed one: the breaker must not stay probing)
            log.exception("probe of engine %s failed", e.cfg.name)
            ok, why = False, f"probe failed: {type(exc).__name__}"
        e.breaker.on_probe(ok, self.clock(), self.cfg.monitoring, why)
        if ok:
            self.on_closed()

    def cancel(self) -> None:
        for t in list(self.tasks):
            t.cancel()


def update_drift(engines: dict[str, EngineState], now: float, cfg: NarwhalConfig,
                 maintenance: frozenset[str] = frozenset()) -> list[str]:
    """Take out of rotation the engines whose drift score passed ``placement.drift_out_at`` (as
    many as the fleet can spare: :func:`~narwhal_serve.placement.health.may_open`); their TTFT and
    TPOT models, and the error margins judged with them, start again from their priors, for the
    profiles to re-measure.  The names taken out."""
    out: list[str] = []
    for e in engines.values():
        if e.drift.should_go_out(cfg.placement) \
                and may_open(_out_of_work(engines, now, maintenance, e), len(engines), cfg.monitoring):
            why = (f"measured TTFT {e.drift.ttft:+.0%} and TPOT {e.drift.tpot:+.0%} against its models "
                   f"(out past {cfg.placement.drift_out_at:+.0%})")
            e.drift.go_out(now, why)
            log.warning("engine %s out of rotation for drift: %s; re-measured with profiling requests", e.cfg.name, why)
            e.ttft_model = PrefillModel(prior_a=e.ttft_model.prior_a, prior_b=e.ttft_model.prior_b)
            e.tpot_model = TpotModel(prior_a=e.tpot_model.prior_a, prior_b=e.tpot_model.prior_b)
            # and the margins: their errors were the dropped models' (those that took it out)
            e.ttft_errors = ErrorWindow(quantile=e.ttft_errors.quantile)
            e.ttft_idle_errors = ErrorWindow(quantile=e.ttft_idle_errors.quantile)
            out.append(e.cfg.name)
    return out


def profile_errors(e: EngineState, p: Profile, cfg: NarwhalConfig) -> ProfileErrors:
    """A profile's relative errors against the engine's models (none where a model has no data
    yet: just re-measured), then the profile taught to them."""
    x = e.pending_prefill_tokens + p.prompt_tokens
    batch = e.in_flight() + 1
    ttft = tpot = None
    if e.ttft_model.samples:
        ttft = rel_error(p.ttft_s, e.ttft_model.predict(x, e.pending_prefill_requests), cfg.placement.drift_min_ttft_s)
    if p.tpot_s is not None and e.tpot_model.samples:
        tpot = rel_error(p.tpot_s, e.tpot_model.predict(batch), cfg.placement.drift_min_tpot_s)
    e.ttft_model.observe(x, p.ttft_s, e.pending_prefill_requests)
    if p.tpot_s is not None:
        e.tpot_model.observe(batch, p.tpot_s)
    return ProfileErrors(ttft, tpot)


class Profiler:
    """Profiling requests to engines out for drift: at most one in flight per engine."""

    def __init__(self, cfg: NarwhalConfig, clock: Callable[[], float], on_back: Callable[[], None]) -> None:
        self.cfg = cfg
        self.clock = clock
        self.on_back = on_back  # called when an engine came back (queued requests may fit)
        self.tasks: set[asyncio.Task[None]] = set()
        self.sent = 0

    def start_due(self, engines: Iterable[EngineState], client: httpx.AsyncClient) -> None:
        now = self.clock()
        for e in engines:
            if e.drift.profile_due(now, self.cfg.placement):
                size = PROFILE_PROMPT_CHARS[e.drift.profile_sent(now, self.cfg.placement)]
                task = asyncio.get_running_loop().create_task(self._profile(e, client, size))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _profile(self, e: EngineState, client: httpx.AsyncClient, size: int) -> None:
        self.sent += 1
        timeout = self.cfg.serving.first_token_limit(self.cfg.admission.max_ttft_budget_s)
        try:
            p = await profile_one(client, e, self.cfg.model, size, PROFILE_OUTPUT_TOKENS, timeout, self.clock)
            errors = profile_errors(e, p, self.cfg) if p.ok else ProfileErrors()
            ok, why = p.ok, p.why
        except Exception as exc:  # (one that raised is a failed one: the next must still be sent)
            log.exception("profile of engine %s failed", e.cfg.name)
            errors, ok, why = ProfileErrors(), False, f"profile failed: {type(exc).__name__}"
        if not ok:
            e.drift.last_reason = why
        if e.drift.on_profile(ok, errors, self.clock(), self.cfg.placement):
            log.warning("engine %s back in rotation after %d profiling requests", e.cfg.name, e.drift.profiles)
            self.on_back()

    def cancel(self) -> None:
        for t in list(self.tasks):
            t.cancel()
