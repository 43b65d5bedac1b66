"""A client may not change how an engine reports its KV cache (found by a read-only review of the
KV-event path; failed before its fix): ``vllm_xargs: {"kv_cache_report_mode": "full"}`` has vLLM
announce a prefix-cache hit's blocks again as stored (vllm/v1/core/kv_cache_manager.py), each a
copy more in the router's index, so the engine's one eviction left the block there for good."""

from __future__ import annotations

import json
import time

from narwhal_serve.engines.vllm import VLLMDialect, client_body
from narwhal_serve.kvevents.index import KVEventIndex
from narwhal_serve.kvevents.wire import BlockRemoved, BlockStored, KVEventBatch
from narwhal_serve.placement.prefix import id_block_hashes
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.resume import continuation_body
from tests.support.kvindex import Held


def test_what_full_report_mode_would_do_to_the_index() -> None:
    """(Why it matters: re-announced blocks outlive their eviction in the index.)"""
    t = Held()
    idx = KVEventIndex(64, 1 << 20, t)
    toks = list(range(1000, 1064))
    hashes = [bytes([65 + i]) * 32 for i in range(4)]
    for seq in range(3):  # stored once, then announced again by two hits in "full" mode
        idx.offer(seq, KVEventBatch(time.time(), [BlockStored(hashes, None, toks, 16, None, "GPU", None)]))
    idx.offer(3, KVEventBatch(time.time(), [BlockRemoved([h], "GPU") for h in hashes]))  # evicted: its only copy
    assert id_block_hashes(toks, 64, 128)[0] in t.held


def test_a_clients_kv_cache_report_mode_never_reaches_a_vllm_engine() -> None:
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "q"}],
            "vllm_xargs": {"kv_cache_report_mode": "full", "keep": 1}}
    assert client_body(json.loads(json.dumps(body)))["vllm_xargs"] == {"keep": 1}
    req = parse_request("chat", json.dumps(body).encode(), model="m")
    leg = VLLMDialect().decode_body(req)
    assert leg["vllm_xargs"] == {"keep": 1}, leg
    out = continuation_body(req, [1, 2, 3], [4])  # (a resume's continuation too)
    assert out is not None and (out.get("vllm_xargs") or {}) == {"keep": 1}, out
