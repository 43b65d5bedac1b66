"""A KV-event index's target for tests: the router blocks it says the engine holds, as a set."""

from __future__ import annotations


class Held:
    def __init__(self) -> None:
        self.held: set[int] = set()

    def insert(self, hashes: list[int]) -> None:
        self.held.update(hashes)

    def remove(self, hashes: list[int]) -> None:
        self.held.difference_update(hashes)

    def clear(self) -> None:
        self.held.clear()
