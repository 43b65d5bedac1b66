"""One engine's KV-event stream applied, in sequence order, to the router's prefix index.

The engine names its blocks by its own hashes (vLLM: SHA-256 of parent, tokens and extra keys); the
router keys its index by its own chained hash of token-ID blocks (:func:`next_id_block_hash`, the
hash every ingress computes for a request's prompt), of ``placement.prefix_block_tokens`` tokens.
A ``BlockStored`` carries the blocks' token IDs, so the router computes its keys from them and needs
the engine's hash function only as a join key (parent → child, and for ``BlockRemoved``).  When the
router's block is several engine blocks (64 tokens over 16-token engine blocks), a router block is
held once all of its engine blocks are, and leaves the index as soon as any of them is removed.  When
an engine block is several router blocks (vLLM-CPU's 128 over the router's 64), each engine block
puts all of its router blocks in the index and takes them out together; admission credits a match
only in whole engine blocks (``cache_block_tokens``), since the engine reuses nothing finer.

Sequence numbers: a batch with the next number is applied; one further ahead is a *gap* (the caller
asks the replay socket for what it missed, and resyncs — index cleared, rebuilt from what follows —
when the replay cannot cover it); an older number with a newer timestamp is a *restarted publisher*
(its cache is new: the index is cleared); an older one with an older timestamp is a duplicate (a
replayed batch that also arrived live) and is skipped.

Memory is bounded: at most ``capacity`` engine blocks are remembered (the engine's KV capacity; its
own ``BlockRemoved`` events normally keep it far below), the oldest forgotten first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from narwhal_serve.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from narwhal_serve.placement.prefix import id_bytes

_ID_WIDTH: Final = array("Q").itemsize


def _raw(ids: list[int]) -> bytes | None:
    """An engine block's token IDs as the router hashes them (None: one past 64 bits)."""
    try:
        return id_bytes(ids)
    except (OverflowError, TypeError):
        return None


def _router_hash(prev: int | None, raw: bytes) -> int:
    """:func:`~narwhal_serve.placement.prefix.next_id_block_hash` of the IDs whose bytes are ``raw``
    (the same bytes hashed: the key every ingress computes for the prompt)."""
    seed = b"" if prev is None else prev.to_bytes(8, "big")
    return int.from_bytes(hashlib.blake2b(seed + b"i" + raw, digest_size=8).digest(), "big")

Verdict = Literal["applied", "duplicate", "gap", "restart"]
DEVICE_MEDIA: Final = (None, "GPU")  # vLLM's device cache (its MEDIUM_GPU, on CPU backends too)


class Target(Protocol):
    """What the events update (the engine's :class:`~narwhal_serve.placement.prefix.PrefixIndex`)."""

    def insert(self, hashes: list[int]) -> None: ...
    def remove(self, hashes: Iterable[int]) -> None: ...
    def clear(self) -> None: ...


# One engine block the index follows: a plain tuple of untracked values (ints, bytes, None and
# tuples of those), which the garbage collector stops following after its first pass over it.  As
# objects (a slots dataclass and a list each), an index at 1,000 engines of Mooncake-length prompts
# was 2.5 million objects that each of the collector's full passes walked: about 0.4 s a pass,
# during which a shard's loop stands still (docs/performance.md, "Scale: what one scheduler holds").
#   (parent, depth, tokens, ours, covered_by)
#   parent: the engine's hash of the block before it (None: the first)
#   depth: engine blocks from the start of the prompt (1: the first)
#   tokens: its token IDs as the router hashes them (little-endian unsigned 64-bit, placement/prefix.py
#     id_bytes; None: an ID past 64 bits, never hashed), kept while another router block may still
#     need them: a block inside a router block keeps them (a second prompt may branch after it and
#     need them to hash its own router block), the block ending one drops them once it is hashed
#   ours: the router block ending at this engine block (None: none, or not known)
#   covered_by: the router blocks this engine block is part of (() : none)
_Node = tuple[Any, int, bytes | None, int | None, tuple[int, ...]]
_PARENT: Final = 0
_DEPTH: Final = 1
_TOKENS: Final = 2
_OURS: Final = 3
_COVERED: Final = 4


@dataclass
class KVEventIndex:
    router_block_tokens: int
    capacity: int
    target: Target
    on_block_size: "Callable[[int], None] | None" = None  # told the engine's block size when it is learned
    # router blocks of a prompt's start that a request can match (``placement.prefix_max_blocks``:
    # an ingress hashes no more of a prompt); deeper ones are neither hashed nor put in the target
    # (None: all)
    max_blocks: int | None = None
    last_seq: int | None = None
    last_ts: float = 0.0
    engine_block_size: int | None = None
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("batches", "stored", "removed", "cleared", "orphans", "malformed", "duplicates", "gaps", "restarts",
         "resyncs", "incompatible", "other_medium"), 0))
    _nodes: "OrderedDict[Any, _Node]" = field(default_factory=OrderedDict)
    # engine hashes the engine holds more than one copy of (vLLM does not de-duplicate cached
    # blocks: two requests caching the same new prefix at once store it twice, each copy announced,
    # each evicted on its own; the block stays a hit until its last copy goes)
    _copies: dict[Any, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._nodes)

    # ------------------------------------------------------------------ sequencing

    def classify(self, seq: int, batch: KVEventBatch) -> Verdict:
        last = self.last_seq
        if last is None or seq == last + 1:
            return "applied"
        if seq > last + 1:
            return "gap"
        return "restart" if batch.ts > self.last_ts else "duplicate"

    def offer(self, seq: int, batch: KVEventBatch) -> Verdict:
        """Apply ``batch`` if it is the next one; say what it was otherwise (a gap is not applied)."""
        verdict = self.classify(seq, batch)
        if verdict == "duplicate":
            self.stats["duplicates"] += 1
            return verdict
        if verdict == "gap":
            self.stats["gaps"] += 1
            return verdict
        if verdict == "restart":
            self.restarted()
        self.apply(seq, batch)
        return verdict

    def restarted(self) -> None:
        """The publisher started again (its sequence went back): forget everything; the batches of
        the new sequence come next (the one offered, or from its first: the subscriber replays them)."""
        self.stats["restarts"] += 1
        self.clear()
        self.last_seq = None

    def resync(self, seq: int, batch: KVEventBatch) -> None:
        """What was missed cannot be replayed: forget everything and go on from ``batch``."""
        self.stats["resyncs"] += 1
        self.clear()
        self.apply(seq, batch)

    def clear(self) -> None:
        self._nodes.clear()
        self._copies.clear()
        self.target.clear()

    # ------------------------------------------------------------------ events

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        # the last batch's time, not the latest ever seen: one batch stamped in the future (a clock
        # stepped back since, or skewed) made a restarted engine's batches duplicates for good
        self.last_seq, self.last_ts = seq, batch.ts
        self.stats["batches"] += 1
        for ev in batch.events:
            if isinstance(ev, (BlockStored, BlockRemoved)) and ev.medium not in DEVICE_MEDIA:
                # a block copied to (or dropped from) another tier — vLLM's CPU offloading: the
                # device's own cache is what the index follows (a CPU-tier removal took blocks the
                # device still held out of it, found by a hostile review)
                self.stats["other_medium"] += 1
            elif isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.stats["cleared"] += 1
                self.clear()

    def _stored(self, ev: BlockStored) -> None:
        b, r = ev.block_size, self.router_block_tokens
        if b <= 0 or len(ev.token_ids) != b * len(ev.block_hashes):
            self.stats["malformed"] += 1
            return
        if r % b and b % r:
            self.stats["incompatible"] += 1  # one block size must be a multiple of the other
            return
        if b != self.engine_block_size:
            self.engine_block_size = b
            if self.on_block_size is not None:
                self.on_block_size(b)
        if ev.lora_id is not None or ev.lora_name is not None or any(k for k in ev.extra_keys or ()):
            return  # a LoRA's, a cache salt's or a multimodal prompt's blocks are not the plain prompt's
        nodes = self._nodes
        parent = nodes.get(ev.parent_block_hash) if ev.parent_block_hash is not None else None
        if ev.parent_block_hash is not None and parent is None:
            self.stats["orphans"] += len(ev.block_hashes)  # its prefix was missed: learned again once re-cached
            return
        parent_h = ev.parent_block_hash
        per = max(1, r // b)
        fresh = 0  # the depth of the last block this event stored anew
        for i, h in enumerate(ev.block_hashes):
            node = nodes.get(h)
            if node is not None:  # another copy of a block (vLLM announces a block when it is cached)
                self._copies[h] = self._copies.get(h, 1) + 1
                nodes.move_to_end(h)
                d = node[_DEPTH]
                if b <= r and d % per == 0 and d - per < fresh and node[_TOKENS] == b"":
                    # it ends a router block one of whose blocks before it was stored again (it
                    # had been evicted, taking the router block out): the router block is whole again
                    raw = _raw(ev.token_ids[i * b:(i + 1) * b])
                    if raw is not None:
                        node = self._complete(h, (node[_PARENT], d, raw, node[_OURS], node[_COVERED]), per)
                parent, parent_h = node, h
                continue
            depth = parent[_DEPTH] + 1 if parent is not None else 1
            # past placement.prefix_max_blocks no request matches it: its tokens are not kept, nor
            # is it hashed or put in the target
            deep = self.max_blocks is not None and self._blocks_before(depth, b) >= self.max_blocks
            node = nodes[h] = (parent_h, depth, b"" if deep else _raw(ev.token_ids[i * b:(i + 1) * b]), None, ())
            fresh = depth
            self.stats["stored"] += 1
            if not deep:
                if b > r:
                    node = self._split(h, node, parent, r)
                elif depth % per == 0:
                    node = self._complete(h, node, per)
            parent, parent_h = node, h
        while len(nodes) > self.capacity:
            old_h, old = nodes.popitem(last=False)
            self._copies.pop(old_h, None)
            if old[_COVERED]:
                self.target.remove(old[_COVERED])

    def _blocks_before(self, depth: int, b: int) -> int:
        """Router blocks wholly before an engine block of ``b`` tokens at ``depth``."""
        r = self.router_block_tokens
        return (depth - 1) * (b // r) if b > r else (depth - 1) // (r // b)

    def _split(self, h: Any, node: _Node, parent: _Node | None, r: int) -> _Node:
        """An engine block (``h``) of several router blocks: all of them, chained from the one
        before.  Returns the node as it is now."""
        raw = node[_TOKENS]
        if (parent is not None and parent[_OURS] is None) or raw is None:
            return node
        step = r * _ID_WIDTH
        first = self._blocks_before(node[_DEPTH], len(raw) // _ID_WIDTH)
        prev = None if parent is None else parent[_OURS]
        ours: list[int] = []
        for k in range(0, len(raw), step):
            if self.max_blocks is not None and first + len(ours) >= self.max_blocks:
                break
            prev = _router_hash(prev, raw[k:k + step])
            ours.append(prev)
        node = self._nodes[h] = (node[_PARENT], node[_DEPTH], b"", prev, tuple(ours))
        self.target.insert(ours)
        return node

    def _complete(self, h: Any, last: _Node, per: int) -> _Node:
        """``last`` (``h``) ends a router block: hash it from its engine blocks' tokens (its own,
        and those its blocks before it keep).  Returns ``last`` as it is now.

        The blocks before it may be shared with other prompts that branch after them (a system
        prompt, a chat's history): each such block is part of every router block built on it, so
        it keeps its tokens and lists all of those router blocks (its removal takes each out).  A
        router block's hash is always of its own tokens — never one found on a block it shares
        with another prompt (a review found that: the other prompt's hash, and every later block
        of this prompt chained from it)."""
        nodes = self._nodes
        chain = [(h, last)]
        node = last
        for _ in range(per - 1):
            key = node[_PARENT]
            node_or_none = nodes.get(key)
            if node_or_none is None:
                return last
            node = node_or_none
            chain.append((key, node))
        prev: int | None = None
        if node[_DEPTH] > 1:
            before = nodes.get(node[_PARENT])
            if before is None or before[_OURS] is None:
                return last  # the router block before it is not known: neither is this one's hash
            prev = before[_OURS]
        parts = [n[_TOKENS] for _, n in reversed(chain)]
        if any(not p for p in parts):
            return last  # an ID past 64 bits (or tokens not kept): no ingress hashes it this way
        ours = _router_hash(prev, b"".join(parts))
        for key, n in chain[1:]:  # the blocks before it: part of this router block too
            if ours not in n[_COVERED]:
                nodes[key] = (n[_PARENT], n[_DEPTH], n[_TOKENS], n[_OURS], (*n[_COVERED], ours))
        # the block ending it: hashed, its tokens are not needed again (a stored-again block
        # brings them with it)
        nodes[h] = (last[_PARENT], last[_DEPTH], b"", ours, (ours,))
        self.target.insert([ours])
        return nodes[h]

    def _removed(self, hashes: list[Any]) -> None:
        for h in hashes:
            copies = self._copies.get(h)
            if copies is not None:  # one copy of several evicted: the block is still held
                if copies > 2:
                    self._copies[h] = copies - 1
                else:
                    del self._copies[h]
                continue
            node = self._nodes.pop(h, None)
            if node is None:
                continue
            self.stats["removed"] += 1
            if node[_COVERED]:
                self.target.remove(node[_COVERED])

    def view(self) -> dict[str, Any]:
        return {"last_seq": self.last_seq, "engine_blocks": len(self._nodes), "engine_block_size": self.engine_block_size,
                **self.stats}
