"""Retry-After a client can trust: room kept for the clients told to come back.

Under sustained overload, predictive admission keeps every engine's projected TTFT near the budget,
so a client that comes back after its ``Retry-After`` finds the room refilled by new arrivals and is
refused again about as often as the first time.  A refusal for projected TTFT therefore reserves
the refused request's prefill work on the engine it was judged on, due when its ``Retry-After``
ends (until ``RETRY_GRACE_S`` later): new requests see that work as already queued once it falls
within their own TTFT budget; a retry does not, and takes the earliest reservation.

Reservations are bounded: a refusal keeps room only while the prefill already booked at that
engine, due by its own due time, plus its own stays within ``BOOKED_SHARE`` of its TTFT budget
(at the engine's measured prefill speed).  Past that it keeps none (its ``Retry-After`` is as
honest, its retry takes its chances): unbounded, every refusal of long prompts made the next
new request look further over budget, and refusals snowballed until an idle fleet refused
almost everything but retries.

Only clients that say they retry get a reservation: those that send ``X-Stainless-Retry-Count`` —
the official OpenAI SDKs send it with every request (0, then the retry count), honour
``Retry-After`` on 429 and retry twice by default.  A request with a count of 1 or more is a retry.
Pure: ``now`` passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

RETRY_GRACE_S = 2.0  # a reservation whose client has not come back this long after its due time is dropped
BOOKED_SHARE = 0.5  # reservations at an engine never book more than this share of a TTFT budget of prefill
MAX_RESERVATIONS = 1024  # held at once (the oldest dropped first)


@dataclass(frozen=True)
class Reservation:
    id: str  # the refused request's ticket
    engine: str  # the first-token engine of the route it was judged on
    due: float  # wall clock: when its Retry-After ends
    until: float  # dropped after this
    tokens: int  # the prefill work it will bring

    def live(self, now: float) -> bool:
        return now <= self.until


def reserved_at(reservations: Iterable[Reservation], engine: str, now: float, horizon_s: float) -> tuple[int, int]:
    """Prompt tokens and requests reserved at ``engine`` that are due within ``horizon_s`` (a new
    request's TTFT budget: what will be queued before its first token) and not yet dropped."""
    tokens = requests = 0
    for r in reservations:
        if r.engine == engine and r.due <= now + horizon_s and r.live(now):
            tokens += r.tokens
            requests += 1
    return tokens, requests


def earliest(reservations: Iterable[Reservation], now: float, taken: frozenset[str] | set[str] = frozenset()
             ) -> Reservation | None:
    """The reservation a retry takes: the earliest due that is live and not taken."""
    best: Reservation | None = None
    for r in reservations:
        if r.live(now) and r.id not in taken and (best is None or r.due < best.due):
            best = r
    return best


def retry_count(header: str | None) -> int | None:
    """``X-Stainless-Retry-Count`` as an int (None: absent or not a small non-negative integer)."""
    v = header.strip() if header is not None else ""
    if not v or len(v) > 4 or not (v.isascii() and v.isdigit()):  # ("²".isdigit() is true)
        return None
    return int(v)
