"""Drift: an engine measured slower than its own models, scored, penalized, taken out and re-measured.

Each finished request compares the engine's measured TTFT and TPOT with what its models predicted
at admission (relative error, EWMA): the drift score is the worse of the two.  Past
``placement.drift_penalty_at`` the engine's placement cost grows with the score; past
``drift_out_at`` it leaves rotation (never more of the fleet than breakers may take, never the
last engine) and its TTFT and TPOT models start again from what profiling requests measure (the
scheduler's own small streamed requests of a few prompt sizes, token-ID-validated; a measurement
whose ID list is bad is discarded).  It comes back once ``drift_probes`` profiles in a row land
within ``drift_back_at`` of what the re-measured models predicted before each: it behaves as
measured again, fast or slow, and admission projects it truthfully.  Pure: ``now`` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from narwhal_serve.config import PlacementConfig

EWMA = 0.2  # weight of each new relative error in a drift score
# The profiling requests' prompts (characters: about a quarter as many tokens), in turn
PROFILE_PROMPT_CHARS = (256, 1024, 4096)
PROFILE_OUTPUT_TOKENS = 8


@dataclass
class Drift:
    ttft: float = 0.0  # EWMA of (measured - predicted) / predicted TTFT; > 0: slower than modelled
    tpot: float = 0.0  # the same for TPOT
    out: bool = False  # out of rotation, being re-measured
    since: float = 0.0  # when it went out (or came back)
    good: int = 0  # profiles in a row within drift_back_at
    profiles: int = 0  # profiling requests sent while out (this time)
    next_profile: float = 0.0
    outs: int = 0  # times it went out (metrics)
    last_reason: str = ""

    @property
    def score(self) -> float:
        return max(self.ttft, self.tpot)

    def observe_ttft(self, measured: float, predicted: float) -> None:
        self.ttft = (1 - EWMA) * self.ttft + EWMA * _rel(measured, predicted)

    def observe_tpot(self, measured: float, predicted: float) -> None:
        self.tpot = (1 - EWMA) * self.tpot + EWMA * _rel(measured, predicted)

    def penalty(self, cfg: PlacementConfig) -> float:
        """Placement cost multiplier - 1: zero up to ``drift_penalty_at``, then the excess."""
        return max(0.0, self.score - cfg.drift_penalty_at)

    def should_go_out(self, cfg: PlacementConfig) -> bool:
        return not self.out and self.score > cfg.drift_out_at

    def go_out(self, now: float, reason: str) -> None:
        self.out, self.since, self.good, self.profiles = True, now, 0, 0
        self.next_profile = now
        self.outs += 1
        self.last_reason = reason

    def profile_due(self, now: float) -> bool:
        return self.out and now >= self.next_profile

    def profile_sent(self, now: float, cfg: PlacementConfig) -> int:
        """Mark a profile in flight; the prompt size index to use."""
        self.next_profile = now + cfg.drift_probe_s + 3600.0  # until its answer (on_profile) re-arms it
        i = self.profiles % len(PROFILE_PROMPT_CHARS)
        self.profiles += 1
        return i

    def on_profile(self, ok: bool, errors: tuple[float, ...], now: float, cfg: PlacementConfig) -> bool:
        """A profile's answer: ``errors`` are its relative errors against the re-measured models'
        predictions (empty while they have nothing to predict from).  True when it comes back."""
        self.next_profile = now + cfg.drift_probe_s
        if not ok:
            self.good = 0
            return False
        if errors and all(abs(x) <= cfg.drift_back_at for x in errors):
            self.good += 1
        elif errors:
            self.good = 0
        if self.good >= cfg.drift_probes:
            self.out, self.since, self.good = False, now, 0
            self.ttft = self.tpot = 0.0
            return True
        return False

    def view(self, now: float) -> dict[str, object]:
        return {"drift_score": round(self.score, 4), "drift_ttft": round(self.ttft, 4),
                "drift_tpot": round(self.tpot, 4), "drift_out": self.out,
                "drift_out_for_s": round(now - self.since, 3) if self.out else None,
                "drift_outs_total": self.outs, "drift_profiles": self.profiles if self.out else 0,
                "drift_reason": self.last_reason or None}


def _rel(measured: float, predicted: float) -> float:
    return (measured - predicted) / max(predicted, 1e-3)
