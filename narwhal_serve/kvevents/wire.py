"""The KV-event wire format of vLLM 0.32 (``vllm/distributed/kv_events.py``), as msgspec structs
with the same tags, field order and encoding options, so what the simulator publishes decodes in
vLLM's own consumers and what vLLM publishes decodes here."""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = -1  # the replay socket's end-of-replay marker


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[Any]  # bytes (vLLM's default) or int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
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
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) for a payload that is not a batch."""
    return _decoder.decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)
