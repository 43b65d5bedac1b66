"""vLLM's KV-cache events as the router's source of cache truth.

* :mod:`.wire` — the wire format vLLM publishes (``--kv-events-config``): ZMQ multipart
  ``(topic, seq: 8 bytes big-endian, payload)``, the payload a msgpack ``KVEventBatch``
  ``[ts, events, data_parallel_rank]`` of tagged ``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``; a ROUTER replay socket answers ``start seq`` with the buffered batches and an
  end marker (seq -1).  The simulator publishes the same bytes.
* :mod:`.index` — pure: applies batches in sequence order to one engine's prefix index, keyed by the
  router's own hash of token-ID blocks (vLLM's block hashes are only the join keys), detects gaps
  and publisher restarts.
* :mod:`.subscriber` — per engine, in the scheduler: SUB + replay, reconnects, resync.
* :mod:`.shard` — the same, for a slice of the engines in a shard of its own
  (``placement.kv_event_shards``): the router blocks each engine added and removed, taken by the
  scheduler in a long poll and applied to its prefix sets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "AllBlocksCleared": "wire",
    "BlockRemoved": "wire",
    "BlockStored": "wire",
    "END_SEQ": "wire",
    "Event": "wire",
    "KVEventBatch": "wire",
    "KVEventIndex": "index",
    "KVEventSubscriber": "subscriber",
    "KVShard": "shard",
    "MAX_ENGINE_BLOCKS": "shard",
    "RESTART_S": "subscriber",
    "ShardLink": "shard",
    "TAKE_WAIT_S": "shard",
    "Taken": "shard",
    "apply_delta": "shard",
    "encode_batch": "wire",
    "follow_forever": "subscriber",
    "seq_bytes": "wire",
    "seq_of": "wire",
}
__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "END_SEQ", "Event", "KVEventBatch", "KVEventIndex",
    "KVEventSubscriber", "KVShard", "MAX_ENGINE_BLOCKS", "RESTART_S", "ShardLink", "TAKE_WAIT_S", "Taken",
    "apply_delta", "encode_batch", "follow_forever", "seq_bytes", "seq_of",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.kvevents.wire import AllBlocksCleared as AllBlocksCleared
    from narwhal_serve.kvevents.wire import BlockRemoved as BlockRemoved
    from narwhal_serve.kvevents.wire import BlockStored as BlockStored
    from narwhal_serve.kvevents.wire import END_SEQ as END_SEQ
    from narwhal_serve.kvevents.wire import Event as Event
    from narwhal_serve.kvevents.wire import KVEventBatch as KVEventBatch
    from narwhal_serve.kvevents.index import KVEventIndex as KVEventIndex
    from narwhal_serve.kvevents.subscriber import KVEventSubscriber as KVEventSubscriber
    from narwhal_serve.kvevents.shard import KVShard as KVShard
    from narwhal_serve.kvevents.shard import MAX_ENGINE_BLOCKS as MAX_ENGINE_BLOCKS
    from narwhal_serve.kvevents.subscriber import RESTART_S as RESTART_S
    from narwhal_serve.kvevents.shard import ShardLink as ShardLink
    from narwhal_serve.kvevents.shard import TAKE_WAIT_S as TAKE_WAIT_S
    from narwhal_serve.kvevents.shard import Taken as Taken
    from narwhal_serve.kvevents.shard import apply_delta as apply_delta
    from narwhal_serve.kvevents.wire import encode_batch as encode_batch
    from narwhal_serve.kvevents.subscriber import follow_forever as follow_forever
    from narwhal_serve.kvevents.wire import seq_bytes as seq_bytes
    from narwhal_serve.kvevents.wire import seq_of as seq_of
