"""What vLLM versions other than the recorded 0.32 send in ordinary use, replayed against Narwhal's
real decoder and relay (a differential review across vLLM 0.10 .. newest; each test's docstring names
the version range and the source it was read from; 2026-12-06): the KV events of vLLM 0.10–0.23
(positional arrays; they were all dropped as malformed), and an engine older than 0.10.2 (no token
IDs) told apart in the failure's words."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import msgspec
import pytest

from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.subscriber import KVEventSubscriber
from narwhal_serve.placement.prefix import PrefixIndex, id_block_hashes
from tests.unit.test_dialect_shapes import all_faults, placed, run, sse


# ------------------------------------------------------------ KV events: vLLM 0.10 .. 0.23 layout
#
# vllm/distributed/kv_events.py before vllm-project/vllm#42892 ("Switch event structs from array to
# map encoding", merged 2026-06-09): ``KVCacheEvent`` is declared ``array_like=True, tag=True``, so
# each event goes on the wire as a positional array whose first element is the tag
# (``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]``); the batch is
# the array ``[ts, events, data_parallel_rank]`` in every version.  The structs below declare the
# same options and fields as that file at the two ends of the range (read: the v0.9/0.10 file in the
# index, commit b4e69e0a, and the field list of #42892's description; ai-dynamo/dynamo#10660 checked
# v0.22.1 and v0.23.0: "KVCacheEvent is still array-like").


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event010(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored010(_Event010, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _Removed010(_Event010, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _Cleared010(_Event010, tag="AllBlocksCleared"):
    pass


class _Event023(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored023(_Event023, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _Removed023(_Event023, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class _Cleared023(_Event023, tag="AllBlocksCleared"):
    pass


_IDS = list(range(1000, 1064))  # one router block of 64 tokens: four vLLM blocks of 16
_HASHES = [0xDEADBEEF00000001, 0xDEADBEEF00000002, 0xDEADBEEF00000003, 0xFFFFFFFFFFFFFFFF]


def _legacy_batches(era: str) -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    if era == "0.10":
        stored: Any = _Stored010(_HASHES, None, _IDS, 16, None, "GPU")
        removed: Any = _Removed010([_HASHES[3]], "GPU")
        cleared: Any = _Cleared010()
    else:
        stored = _Stored023(_HASHES, None, _IDS, 16, None, "GPU", None, extra_keys=[None] * 4, group_idx=0,
                            kv_cache_spec_kind="full_attention")
        removed = _Removed023([_HASHES[3]], "GPU", group_idx=0)
        cleared = _Cleared023()
    ts = time.time()
    return [enc.encode(_Batch(ts, [stored], 0)), enc.encode(_Batch(ts, [removed], 0)),
            enc.encode(_Batch(ts, [cleared], 0))]


@pytest.mark.parametrize("era", ["0.10", "0.23"])
def test_kv_events_of_vllm_before_map_encoding_are_decoded(era: str) -> None:
    """vLLM 0.10 through 0.23 (every release before #42892) publish each KV event as a tagged
    positional array.  Narwhal's ``kvevents/wire.py`` declares its event structs without
    ``array_like`` (the map layout of vLLM >= 0.24), so msgspec refuses every such batch ("Expected
    `object`, got `array` - at `$[1][0]`"): the subscriber counts each frame in ``malformed_frames``
    and drops it, the engine's prefix index never fills, and ``prefix_source: kv_events`` silently
    credits nothing, for every engine on these versions, even though the docs tell operators to pass
    ``--kv-events-config`` to any vLLM.  Expected: the batches decode and the router block is indexed,
    then removed, then cleared, as for a 0.32 engine."""
    target = PrefixIndex(1000)
    index = KVEventIndex(64, 10_000, target)
    sub = KVEventSubscriber("e0", "tcp://127.0.0.1:1", None, "", index)
    for seq, payload in enumerate(_legacy_batches(era)):
        got = sub._decode([b"", seq.to_bytes(8, "big", signed=True), payload])
        assert got is not None, f"vLLM {era} batch {seq} dropped as malformed"
        index.offer(*got)
        if seq == 0:
            assert set(target.held()) == set(id_block_hashes(_IDS, 64, 10))
    assert sub.errors["malformed_frames"] == 0
    assert index.stats["stored"] == 4 and index.stats["removed"] == 1 and index.stats["cleared"] == 1


# ------------------------------------------------ token IDs: vLLM 0.10.0 / 0.10.1 ignore the flag
#
# ``return_token_ids`` came with vllm-project/vllm#22587 (Aug 2025; first released in 0.10.2, as
# NVIDIA-NeMo/Gym#1108's "TODO add this when NeMo RL upgrades to vLLM 0.10.2" records).  Before it,
# OpenAIBaseModel (``extra="allow"``) logs "The following fields were present in the request but
# ignored: {'return_token_ids', 'stream_interval'}" and streams its ordinary chunks: no ``token_ids``.

_CHAT_HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _vllm_0_10_1_chat_stream() -> bytes:
    """serving_chat.py chat_completion_stream_generator of 0.10.1: role chunk, content chunks
    (ChatCompletionResponseStreamChoice: index, delta, logprobs, finish_reason, stop_reason), the
    usage chunk; no token-ID field anywhere."""
    def ch(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**_CHAT_HEAD, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish, "stop_reason": None}]}
    usage = {**_CHAT_HEAD, "choices": [], "usage": {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2}}
    return sse(ch({"role": "assistant", "content": ""}), ch({"content": "Hel"}), ch({"content": "lo"}, "stop"),
               usage)


async def test_vllm_0_10_1_answer_without_token_ids_says_what_the_engine_lacks() -> None:
    """The vllm dialect sends ``return_token_ids: true`` and fails any event with output and no ID
    list (the contract's token identity); vLLM 0.10.0/0.10.1 ignore the flag, so every answer fails
    there.  Such an engine is served as dialect ``openai`` (docs/contract.md, "Engine dialects and
    token identity"); the failure says so, not only which field was missing."""
    body = _vllm_0_10_1_chat_stream()
    sent: list[dict[str, Any]] = []

    def handler(r: httpx.Request) -> httpx.Response:
        sent.append(json.loads(r.content))
        return httpx.Response(200, stream=httpx.ByteStream(body))

    msgs, _ = await run(handler, placed("chat", "vllm", stream=False))
    assert sent[0]["return_token_ids"] is True  # what the engine ignores
    last = msgs[-1]
    assert last.error is not None and "vLLM >= 0.10.2" in last.error.message and "dialect openai" in last.error.message, last.error
    msgs, _ = await run(lambda r: httpx.Response(200, stream=httpx.ByteStream(body)), placed("chat", "openai", stream=False))
    assert msgs[-1].error is None and json.loads(msgs[-1].data)["choices"][0]["message"]["content"] == "Hello"
