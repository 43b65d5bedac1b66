"""The router's token-ID block hashes: a whole prompt hashed at once (an ingress) equals the same
blocks learned one at a time (the KV-event index), whatever the IDs."""

from __future__ import annotations

import random

import pytest

from narwhal_serve.placement.prefix import id_block_hashes, next_id_block_hash, text_block_hashes


def one_at_a_time(ids: list[int], block: int, max_blocks: int) -> tuple[int, ...]:
    out: list[int] = []
    prev = None
    for i in range(min(len(ids) // block, max_blocks)):
        prev = next_id_block_hash(prev, ids[i * block:(i + 1) * block])
        out.append(prev)
    return tuple(out)


@pytest.mark.parametrize("block", [1, 16, 64])
def test_a_prompt_hashed_at_once_equals_its_blocks_learned_one_at_a_time(block: int) -> None:
    rng = random.Random(block)
    ids = [rng.randrange(0, 200_000) for _ in range(block * 9 + block // 2)]
    got = id_block_hashes(ids, block, 100)
    assert len(got) == 9 and got == one_at_a_time(ids, block, 100)
    assert id_block_hashes(ids, block, 4) == got[:4]
    assert id_block_hashes(tuple(ids), block, 100) == got  # a parsed request's IDs are a tuple


def test_ids_past_64_bits_hash_without_error_and_still_chain_alike() -> None:
    ids = [5] * 32 + [2**70] + [7] * 31 + [9] * 32
    got = id_block_hashes(ids, 32, 10)
    assert len(got) == 3 and got == one_at_a_time(ids, 32, 10)
    assert got[0] == id_block_hashes([5] * 32, 32, 10)[0]  # the blocks before it hash as usual


def test_different_blocks_differ_and_equal_prefixes_agree() -> None:
    a = id_block_hashes(list(range(128)), 64, 10)
    b = id_block_hashes(list(range(64)) + list(range(1, 65)), 64, 10)
    assert a[0] == b[0] and a[1] != b[1]
    # an ID block never hashes like a text block of the same digits
    assert id_block_hashes([1, 2, 3, 4], 4, 1)[0] not in text_block_hashes("1,2,3,4", 7, 1)
    # nor like the same IDs with one more leading zero byte in some other order
    assert id_block_hashes([1, 256], 2, 1) != id_block_hashes([256, 1], 2, 1)
