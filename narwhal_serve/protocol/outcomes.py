"""Terminal classes of an offered request (docs/contract.md, "Admission"); the values are the metric names' stems."""

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

# The reasons each terminal class is counted under (docs/contract.md, "Errors": the codes; "Admission"): a
# fresh router exports every one of them at zero, so dashboards chart them and rate() sees the first
# increment.  A reason not listed here is still counted when it happens (an engine's own code).
KNOWN_REASONS: dict[Outcome, tuple[str, ...]] = {
    Outcome.REJECTED: ("retention_full", "queue_full", "backend_unavailable", "router_unavailable",
                       "engine_backpressure", "rate_limit_exceeded"),
    Outcome.REFUSED: ("ttft_budget_exceeded", "prompt_exceeds_ttft_budget", "tpot_budget_exceeded",
                      "tpot_budget_unattainable"),
    Outcome.INVALID: ("invalid_request", "model_not_found", "request_too_large", "invalid_api_key",
                      "request_timeout", "invalid_sampling_width", "unsupported_option", "context_length_exceeded"),
    Outcome.EXPIRED: ("admission_wait_expired", "deadline_expired"),
    Outcome.FAILED: ("bad_engine_response", "internal_error", "slow_reader", "router_draining"),
    Outcome.CANCELLED: ("client_disconnected", "body_incomplete"),
}
