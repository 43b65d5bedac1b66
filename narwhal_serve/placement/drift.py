"""Drift: an engine measured slower than its own models, scored, penalized, taken out and re-measured.

Each finished request compares the engine's measured TTFT and TPOT with what its models predicted
at admission: the relative error — against at least ``placement.drift_min_ttft_s`` /
``drift_min_tpot_s``, so that timer noise on a fast engine is not drift, and capped at
``REL_CAP`` per measurement, so that one outlier never decides — feeds an EWMA per quantity; the
drift score is the worse of the two.  Past ``drift_penalty_at`` the engine's placement cost grows
with the score, and while it is penalized and gets no traffic it is profiled, so that a penalty
never starves it of evidence.  Past ``drift_out_at`` it leaves rotation (never more of the fleet
than breakers may take, never the last engine), and its TTFT and TPOT models start again from
what profiling requests measure (the scheduler's own small streamed requests of a few prompt
sizes, token-ID-validated: a measurement whose ID list is bad is discarded).  It comes back once
``drift_probes`` profiles in a row land within ``drift_back_at`` of what the re-measured models
predicted before each: it behaves as measured again, fast or slow, and admission projects it
truthfully.  Pure: ``now`` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from narwhal_serve.config import PlacementConfig

EWMA = 0.2  # weight of each new relative error in a drift score
REL_CAP = 2.0  # one measurement counts as at most "3× slower than modelled"
# The profiling requests' prompts (characters: about a quarter as many tokens), in turn
PROFILE_PROMPT_CHARS = (256, 1024, 4096)
PROFILE_OUTPUT_TOKENS = 8


def rel_error(measured: float, predicted: float, floor: float) -> float:
    """(measured - predicted) / max(predicted, floor), within [-1, REL_CAP]."""
    return max(-1.0, min(REL_CAP, (measured - predicted) / max(predicted, floor)))


@dataclass(frozen=True)
class ProfileErrors:
    """A profile's relative errors against the engine's models (None: nothing to compare)."""

    ttft: float | None = None
    tpot: float | None = None

    def values(self) -> tuple[float, ...]:
        return tuple(x for x in (self.ttft, self.tpot) if x is not None)


@dataclass
class Drift:
    ttft: float = 0.0  # EWMA of TTFT relative errors; > 0: slower than modelled
    tpot: float = 0.0  # the same for TPOT
    out: bool = False  # out of rotation, being re-measured
    since: float = 0.0  # when it went out (or came back)
    good: int = 0  # profiles in a row within drift_back_at
    profiles: int = 0  # profiling requests sent (this time out, or while penalized)
    next_profile: float = 0.0  # no profile before this (one in flight at a time)
    last_sample: float = 0.0  # when a request last taught it something
    outs: int = 0  # times it went out (metrics)
    last_reason: str = ""

    @property
    def score(self) -> float:
        return max(self.ttft, self.tpot)

    def observe_ttft(self, rel: float, now: float) -> None:
        self.ttft = (1 - EWMA) * self.ttft + EWMA * rel
        self.last_sample = now

    def observe_tpot(self, rel: float, now: float) -> None:
        self.tpot = (1 - EWMA) * self.tpot + EWMA * rel
        self.last_sample = now

    def penalty(self, cfg: PlacementConfig) -> float:
        """Placement cost multiplier - 1: zero up to ``drift_penalty_at``, then the excess."""
        return 0.0 if self.out else max(0.0, self.score - cfg.drift_penalty_at)

    def should_go_out(self, cfg: PlacementConfig) -> bool:
        return not self.out and self.score > cfg.drift_out_at

    def go_out(self, now: float, reason: str) -> None:
        self.out, self.since, self.good, self.profiles = True, now, 0, 0
        if self.next_profile != float("inf"):  # (a profile in flight: its answer re-arms the next one)
            self.next_profile = now
        self.outs += 1
        self.last_reason = reason

    def profile_due(self, now: float, cfg: PlacementConfig) -> bool:
        """Out: every ``drift_probe_s``.  In rotation: while penalized and taught nothing for that long."""
        if now < self.next_profile:
            return False
        return self.out or (self.score > cfg.drift_penalty_at and now - self.last_sample >= cfg.drift_probe_s)

    def profile_sent(self, now: float, cfg: PlacementConfig) -> int:
        """Mark a profile in flight; the index of the prompt size to use."""
        self.next_profile = float("inf")  # until its answer (on_profile) re-arms it
        i = self.profiles % len(PROFILE_PROMPT_CHARS)
        self.profiles += 1
        return i

    def on_profile(self, ok: bool, errors: ProfileErrors, now: float, cfg: PlacementConfig) -> bool:
        """A profile's answer.  In rotation its errors count like a request's; out, it counts
        toward coming back.  True when the engine comes back."""
        self.next_profile = now + cfg.drift_probe_s
        if not self.out:
            if ok and errors.ttft is not None:
                self.observe_ttft(errors.ttft, now)
            if ok and errors.tpot is not None:
                self.observe_tpot(errors.tpot, now)
            return False
        values = errors.values()
        if not ok:
            self.good = 0
        elif values and all(abs(x) <= cfg.drift_back_at for x in values):
            self.good += 1
        elif values:
            self.good = 0
        if self.good >= cfg.drift_probes:
            self.out, self.since, self.good = False, now, 0
            self.ttft = self.tpot = 0.0
            self.last_sample = now
            return True
        return False

    def view(self, now: float) -> dict[str, object]:
        return {"drift_score": round(self.score, 4), "drift_ttft": round(self.ttft, 4),
                "drift_tpot": round(self.tpot, 4), "drift_out": self.out,
                "drift_out_for_s": round(now - self.since, 3) if self.out else None,
                "drift_outs_total": self.outs, "drift_profiles": self.profiles,
                "drift_reason": self.last_reason or None}
