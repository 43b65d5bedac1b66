"""Engine-side failures, as the relay sees them.

``EngineFailure`` means the attempt failed and another engine may be tried if no response header
has been sent yet; ``BadEngineResponse`` (from :mod:`narwhal_serve.errors`) is the 502 the client
sees when nothing else can be done.
"""

from __future__ import annotations

from typing import Literal

# What a failed attempt tells the engine's breaker (placement/health.py): an error, silence, or a 429/503
FaultKind = Literal["error", "timeout", "backpressure"]

# Engine answers that blame the request itself: retrying elsewhere cannot help, and the client
# gets a 400 with the engine's message and param instead of a 502.
CLIENT_ERROR_STATUSES = frozenset({400, 413, 422})
# Engine answers that mean "busy, come back later": backpressure that shapes load, not a failure.
BACKPRESSURE_STATUSES = frozenset({429, 503})


class EngineFailure(Exception):
    """The engine could not be used for this attempt (connect error, HTTP error, broken stream)."""

    def __init__(
        self,
        engine: str,
        message: str,
        *,
        status: int | None = None,
        upstream_message: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(f"engine {engine}: {message}")
        self.engine = engine
        self.message = message
        self.status = status
        self.upstream_message = upstream_message
        self.param = param
        self.retry_after_s = retry_after_s  # the engine's Retry-After, with a 429/503
        self.timed_out = timed_out  # the engine was silent (idle or first-token limit)

    @property
    def client_error(self) -> bool:
        return self.status in CLIENT_ERROR_STATUSES

    @property
    def backpressure(self) -> bool:
        """The engine is busy (429/503): another engine may take the request; not a failure."""
        return self.status in BACKPRESSURE_STATUSES
