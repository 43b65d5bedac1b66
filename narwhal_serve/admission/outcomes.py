"""Terminal classes of an offered request (README, "Admission"); the values are the metric names' stems."""

from __future__ import annotations

from enum import Enum


class Outcome(str, Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    REJECTED = "rejected"  # capacity rejection (retention, queue, no engine, router unavailable)
    REFUSED = "refused"  # predictive refusal (TTFT budget)
    INVALID = "invalid_requests"  # malformed body and other client errors
    EXPIRED = "expired"  # admission wait or deadline before response headers
    CANCELLED = "cancelled"  # the client went away


TERMINAL = tuple(Outcome)
