"""Helpers for tests that read a relay's messages."""

from __future__ import annotations

from narwhal_serve.relay.messages import EngineFault, EngineWorked, RelayMessage


def faults_of(msg: RelayMessage) -> list[EngineFault]:
    """The failed attempts a message reports (its health events less the first tokens)."""
    return [e for e in msg.health if isinstance(e, EngineFault)]


def health_order(msgs: list[RelayMessage]) -> list[tuple[str, ...] | str]:
    """The health events of ``msgs`` in order: a first token as its route's engines (a tuple), a
    failed attempt as its engine's name."""
    return [e.engines if isinstance(e, EngineWorked) else e.engine for m in msgs for e in m.health]
