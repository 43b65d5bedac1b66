"""The KV-event wire format of vLLM 0.32 (``vllm/distributed/kv_events.py``), as msgspec structs
with the same tags, field order and encoding options, so what the simulator publishes decodes in
vLLM's own consumers and what vLLM publishes decodes here; the events of vLLM 0.10–0.23 (positional
arrays) decode too."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

END_SEQ = -1  # the replay socket's end-of-replay marker


# A block's hash as vLLM publishes it (``ExternalBlockHash``): bytes (its default: SHA-256, 32
# bytes) or int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).  Anything else — a list, a map, 64 KiB of
# bytes — is a batch that does not decode (a malformed frame): taken as a key, it failed mid-batch
# after the sequence number had moved on (the rest of the batch lost), or cost the index its memory
# bound in bytes (found by a hostile review).
BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=64)]
# A block of more tokens than this is no engine's (vLLM's largest page is far below): one such
# block made every prefix match round down to nothing (admission credits whole engine blocks).
MAX_BLOCK_SIZE = 1 << 14


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    # 0: vLLM's CPU-offload connector announces its tier's stores with no tokens (a placeholder in
    # the device's batches, offloading/events.py _placeholder_stored; the index skips other media)
    block_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_SIZE)]
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]  # seconds since the epoch (not NaN, not infinite)
    events: list[Event]
    data_parallel_rank: int | None = None


# vLLM before 0.24 (before vllm-project/vllm#42892: 0.10 to 0.23) sent each event as a tagged
# positional array, its fields in the same order; those added since trail, so each may be absent
# there (0.10's BlockStored ends at ``medium``).  Decoded as the same event types (subclasses).
class _BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    medium: str | None = None


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _KVEventBatchArrays(KVEventBatch, array_like=True, omit_defaults=True, gc=False):
    events: list[_BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray]  # type: ignore[assignment]


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_arrays_decoder = msgspec.msgpack.Decoder(_KVEventBatchArrays)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) for a payload that is not a batch (in
    either encoding of the events)."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError:
        try:
            return _arrays_decoder.decode(payload)
        except msgspec.DecodeError:
            pass
        raise


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)
