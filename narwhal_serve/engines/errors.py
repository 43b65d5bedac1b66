"""Engine-side failures, as the relay sees them.

``EngineFailure`` means the attempt failed and another engine may be tried if no response header
has been sent yet; ``BadEngineResponse`` (from :mod:`narwhal_serve.errors`) is the 502 the client
sees when nothing else can be done.
"""

from __future__ import annotations


class EngineFailure(Exception):
    """The engine could not be used for this attempt (connect error, HTTP error, broken stream)."""

    def __init__(self, engine: str, message: str, *, status: int | None = None) -> None:
        super().__init__(f"engine {engine}: {message}")
        self.engine = engine
        self.message = message
        self.status = status
