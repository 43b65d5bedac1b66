"""Helpers for tests that read a relay's messages."""

from __future__ import annotations

from narwhal_serve.relay.messages import EngineFault, EngineWorked, RelayMessage


def faults_of(msg: RelayMessage) -> list[EngineFault]:
    """The failed attempts a message reports (its health events less the first tokens)."""
    return [e for e in msg.health if isinstance(e, EngineFault)]


def worked_of(msg: RelayMessage) -> list[tuple[str, ...]]:
    """The routes a message reports a first token from."""
    return [e.engines for e in msg.health if isinstance(e, EngineWorked)]
