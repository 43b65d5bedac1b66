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
