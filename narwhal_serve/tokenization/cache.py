"""Token IDs of texts tokenized before (the router's tokenizer and the simulator's share it)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

CACHE_TOKENS = 2_000_000  # token IDs a cache holds at most (least recently used dropped first)


class TokenCache:
    """``encode(text)``, remembered for texts of at least ``min_chars`` characters (shorter ones cost
    less to encode than to hash and book), at most ``capacity_tokens`` IDs held (thread-safe)."""

    def __init__(self, encode: Callable[[str], list[int]], min_chars: int, capacity_tokens: int = CACHE_TOKENS) -> None:
        self._encode = encode
        self._min_chars = min_chars
        self._capacity = capacity_tokens
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __call__(self, text: str) -> list[int]:
        if len(text) < self._min_chars:
            return self._encode(text)
        with self._lock:
            ids = self._hit(text)
        if ids is not None:
            return ids
        ids = self._encode(text)
        with self._lock:
            self._keep(text, ids)
        return ids

    def many(self, texts: Sequence[str], encode_many: Callable[[list[str]], list[list[int]]]) -> list[list[int]]:
        """``encode`` of each of ``texts``: the remembered ones from the cache, the others encoded
        together by ``encode_many`` (one call: a batch the tokenizer may spread over cores)."""
        with self._lock:
            out = [self._hit(text) if len(text) >= self._min_chars else None for text in texts]
        todo = [i for i, ids in enumerate(out) if ids is None]
        if todo:
            new = encode_many([texts[i] for i in todo])
            with self._lock:
                for i, ids in zip(todo, new, strict=True):
                    out[i] = ids
                    if len(texts[i]) >= self._min_chars:
                        self._keep(texts[i], ids)
        return [ids for ids in out if ids is not None]

    def _hit(self, text: str) -> list[int] | None:
        """(under the lock) ``text``'s IDs if remembered (then the most recently used), else None."""
        ids = self._cache.get(text)
        if ids is not None:
            self._cache.move_to_end(text)
            self.hits += 1
        return ids

    def _keep(self, text: str, ids: list[int]) -> None:
        """(under the lock) A miss: remembered, the least recently used dropped past the capacity."""
        self.misses += 1
        if text not in self._cache:
            self._cache[text] = ids
            self._tokens += len(ids)
            while self._tokens > self._capacity and self._cache:
                _, old = self._cache.popitem(last=False)
                self._tokens -= len(old)
