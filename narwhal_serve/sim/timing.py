"""Pure timing model and the block-hash prefix cache.

Nothing here reads a clock: callers pass ``now`` (any monotonic time base) and get deadlines back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.textgen import stable_hash


def prefill_seconds(cfg: SimEngineConfig, uncached_tokens: int) -> float:
    """``prefill_overhead_s + prefill_per_token_s * uncached_tokens``."""
    return cfg.prefill_overhead_s + cfg.prefill_per_token_s * max(0, uncached_tokens)


def token_interval(cfg: SimEngineConfig, running: int) -> float:
    """Time to decode one token while ``running`` sequences share the engine."""
    return cfg.tpot_base_s + cfg.tpot_per_running_s * max(0, running)


def prefill_deadline(cfg: SimEngineConfig, now: float, uncached_tokens: int) -> float:
    """When the prefill of a request admitted at ``now`` finishes (its first token is out)."""
    return now + prefill_seconds(cfg, uncached_tokens)


def next_token_deadline(cfg: SimEngineConfig, prev_deadline: float, now: float, running: int) -> float:
    """Deadline of the next token: one interval after the previous one, never in the past.

    Anchoring on the previous deadline (not on ``now``) keeps timer jitter from accumulating.
    """
    return max(prev_deadline + token_interval(cfg, running), now)


def block_hashes(prompt_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of a prompt (vLLM-style); ``parent``:
    the hash of the block before them (0: they start the prompt)."""
    out: list[int] = []
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        parent = stable_hash(parent, tuple(prompt_ids[start : start + block_size]))
        out.append(parent)
    return out


class PrefixCache:
    """LRU set of block hashes, bounded to ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._next_block_id = 0
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_tokens(self, hashes: Sequence[int], block_size: int) -> int:
        """Tokens covered by the longest cached prefix of ``hashes`` (touches the hits)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        self.queries += len(hashes)
        self.hits += n
        return n * block_size

    def insert(self, hashes: Sequence[int]) -> list[int]:
        """Cache every block; return their (stable while cached) block ids."""
        return self.insert_tracked(hashes)[0]

    def insert_tracked(self, hashes: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """:meth:`insert`, also returning the positions of the blocks newly cached and the hashes
        evicted to make room (what the engine's KV events announce)."""
        ids: list[int] = []
        new: list[int] = []
        for i, h in enumerate(hashes):
            bid = self._blocks.get(h)
            if bid is None:
                bid = self.fresh_block_id()
                self._blocks[h] = bid
                new.append(i)
            else:
                self._blocks.move_to_end(h)
            ids.append(bid)
        evicted: list[int] = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        return ids, new, evicted

    def fresh_block_id(self) -> int:
        """An id for a block that is not cached (the partial last block of a prompt)."""
        bid = self._next_block_id % max(1, self.capacity)
        self._next_block_id += 1
        return bid

    def clear(self) -> None:
        self._blocks.clear()
