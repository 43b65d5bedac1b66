"""A prefix index's frozen copy (what a lease's view carries across the Ray hop) is rebuilt only
when what it holds changed, and is always what a copy made anew would be."""

from __future__ import annotations

import random
from collections import Counter

from narwhal_serve.placement.prefix import PrefixIndex


def anew(blocks: list[int], pending: Counter[int], limit: int) -> frozenset[int]:
    """The definition: the ``limit`` most recently placed or used blocks, and every pending one."""
    return frozenset(list(reversed(blocks))[:limit]) | {h for h, n in pending.items() if n > 0}


def test_the_frozen_copy_is_a_fresh_copy_after_any_sequence_of_changes() -> None:
    rng = random.Random(11)
    for capacity, limit in ((12, 8), (12, 20), (40, 16)):
        idx, blocks, pending = PrefixIndex(capacity), [], Counter[int]()
        for step in range(3000):
            op = rng.choice(("insert", "remove", "pend", "unpend", "pend", "unpend", "read", "touch",
                             "clear"[:5 if step % 97 else 0]))
            hs = [rng.randrange(0, 30) for _ in range(rng.randrange(1, 6))]
            if op == "insert":
                idx.insert(hs)
                for h in hs:
                    if h in blocks:
                        blocks.remove(h)
                    blocks.append(h)
                del blocks[:max(0, len(blocks) - capacity)]
            elif op == "touch":  # a request used them: those held become the most recent
                idx.touch(hs)
                for h in hs:
                    if h in blocks:
                        blocks.remove(h)
                        blocks.append(h)
            elif op == "remove":
                idx.remove(hs)
                blocks = [b for b in blocks if b not in hs]
            elif op == "pend":
                idx.pend(hs)
                pending.update(hs)
            elif op == "unpend":
                hs = [h for h in dict.fromkeys(hs) if pending[h] > 0]  # (a request unpends what it pended)
                if step % 2:
                    idx.unpend(hs)
                    pending.subtract(hs)
                else:  # those held now, the others returned (they wait for the engine's events)
                    assert idx.unpend_stored(hs) == tuple(h for h in hs if h not in blocks)
                    pending.subtract([h for h in hs if h in blocks])
            elif op == "clear":
                idx.clear()
                blocks = []
            before = idx.frozen(limit)
            assert before == anew(blocks, pending, limit), (capacity, limit, step, op)
            assert idx.frozen(limit) is before  # cached until the next change


def test_a_request_pending_on_blocks_held_keeps_the_copy() -> None:
    """A request placed on blocks the engine holds changes nothing a view reads: the same object
    (a grant sends no new set for it); a new block, or its last pending request gone, a new copy."""
    idx = PrefixIndex(64)
    idx.insert(list(range(10)))
    first = idx.frozen(32)
    idx.pend([2, 3, 4])
    assert idx.frozen(32) is first
    idx.unpend([2, 3, 4])
    assert idx.frozen(32) is first
    idx.pend([3, 99])
    second = idx.frozen(32)
    assert second is not first and 99 in second
    idx.pend([99])  # a second request on the same pending block
    assert idx.frozen(32) is second
    idx.unpend([99])
    assert idx.frozen(32) is second  # one still pending
    idx.unpend([99, 3])
    assert idx.frozen(32) == first and 99 not in idx.frozen(32)


def test_a_block_every_request_uses_stays_in_the_copy_however_many_are_stored_after_it() -> None:
    """An index fed by KV events hears of a block once, when the engine stores it; a prefix every
    request then hits (a system prompt) is the engine's most recently used, not its oldest."""
    idx = PrefixIndex(4096)
    idx.insert([1, 2, 3])  # the shared prefix, stored first
    for i in range(10):
        idx.insert(list(range(1000 + 100 * i, 1100 + 100 * i)))  # others' prompts after it
        idx.touch([1, 2, 3, 7777])  # each request used the prefix (a block never stored: nothing)
    assert {1, 2, 3} <= idx.frozen(64) and 7777 not in idx.frozen(64)
    untouched = PrefixIndex(4096)
    untouched.insert([1, 2, 3])
    untouched.insert(list(range(1000, 2000)))
    assert not {1, 2, 3} & untouched.frozen(64)
    first = idx.frozen(64)
    idx.touch([1, 2])  # already among the most recent: the same copy
    assert idx.frozen(64) is first


def test_a_pending_block_stored_keeps_the_copy_while_every_block_is_in_it() -> None:
    """What a KV-event engine does with each request: its blocks are pending, then stored (its
    events), then its prefill is done; the copy holds the same blocks throughout, so it stays the
    same object (no new facts, no grant carries it) — half the rebuilds at 1,000 engines."""
    idx = PrefixIndex(1000)
    idx.insert(list(range(10)))
    idx.frozen(64)
    idx.pend([5, 6, 100, 101])
    copy = idx.frozen(64)
    assert copy == frozenset(range(10)) | {100, 101}
    idx.insert([100, 101])  # the engine stored them
    assert idx.frozen(64) is copy
    idx.touch([101, 100, 3])  # used again: only their order changed
    assert idx.frozen(64) is copy
    idx.unpend_stored([5, 6, 100, 101])
    assert idx.frozen(64) is copy
    idx.pend([7])
    idx.remove([7])  # evicted while a request still pends on it: still in the copy
    assert idx.frozen(64) is copy
    idx.unpend([7])
    assert idx.frozen(64) == copy - {7}
    # more blocks than the copy carries: the most recent ones, rebuilt as they move
    small = PrefixIndex(1000)
    small.insert(list(range(8)))
    first = small.frozen(4)
    assert first == {4, 5, 6, 7}
    small.touch([0])
    assert small.frozen(4) == {0, 5, 6, 7}
    small.insert([5])  # held already, now the most recent
    assert small.frozen(4) == {0, 5, 6, 7}


def test_a_pending_block_evicted_from_a_full_copy_lets_an_older_one_in() -> None:
    """(Found by review.) With more blocks than the copy carries, a block leaving the engine makes
    room among the most recent for an older one, pending or not."""
    idx = PrefixIndex(10)
    idx.insert([1, 2, 3])
    idx.pend([3])
    assert idx.frozen(2) == {2, 3}
    idx.remove([3])  # still pending
    assert idx.frozen(2) == {1, 2, 3}


def test_the_frozen_copy_is_a_fresh_copy_over_many_shapes() -> None:
    """(After a review's fuzzer.) Capacities below, at and above the copy's limit, several limits
    read in turn, arbitrary unpends (never pended, repeated), resizes, clears, iterators for
    lists: the copy is always the definition, and cached until a change."""
    for seed in range(400):
        rng = random.Random(seed)
        capacity = rng.choice([0, 1, 2, 3, 5, 8, 12, 20, 40])
        universe = rng.choice([3, 6, 10, 30, 60])
        limits = rng.sample([0, 1, 2, 3, 5, 8, 12, 20, 50], rng.choice([1, 1, 2, 3]))
        idx, blocks, pending = PrefixIndex(capacity), list[int](), Counter[int]()
        for step in range(300):
            op = rng.choice(("insert", "insert", "remove", "pend", "pend", "unpend", "unpend_stored",
                             "touch", "touch", "read", "clear" if rng.random() < .05 else "read",
                             "resize" if rng.random() < .1 else "read"))
            hs = [rng.randrange(universe) for _ in range(rng.randrange(0, 7))]
            if op == "insert":
                idx.insert(hs)
                if hs and capacity > 0:
                    for h in hs:
                        if h in blocks:
                            blocks.remove(h)
                        blocks.append(h)
                    del blocks[:max(0, len(blocks) - capacity)]
            elif op == "touch":
                idx.touch(iter(hs) if step % 2 else hs)
                for h in hs:
                    if h in blocks:
                        blocks.remove(h)
                        blocks.append(h)
            elif op == "remove":
                idx.remove(hs)
                blocks = [b for b in blocks if b not in hs]
            elif op == "pend":
                idx.pend(iter(hs) if step % 3 == 0 else hs)
                pending.update(hs)
            elif op == "unpend":
                idx.unpend(hs)
                for h in hs:
                    pending[h] = max(0, pending[h] - 1)
            elif op == "unpend_stored":
                later = tuple(h for h in hs if h not in blocks)
                assert idx.unpend_stored(hs) == later
                for h in (hs if not later else [h for h in hs if h in blocks]):
                    pending[h] = max(0, pending[h] - 1)
            elif op == "clear":
                idx.clear()
                blocks = []
            elif op == "resize":
                capacity = rng.choice([0, 1, 2, 4, 8, 12, 40])
                idx.resize(capacity)
                del blocks[:max(0, len(blocks) - capacity)]
            for limit in rng.sample(limits, len(limits)):
                copy = idx.frozen(limit)
                assert copy == anew(blocks, pending, limit), (seed, step, op, limit)
                assert idx.frozen(limit) is copy
