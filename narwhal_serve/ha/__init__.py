"""High availability: the router's own lease (one active router per key) and the states it puts the
router in.

* :mod:`.lease` — The router's own lease (one active router per lease key), judged on its own
  monotonic clock.
* :mod:`.redis_lease` — The lease backend on Redis: one atomic acquire-or-renew script.
* :mod:`.state` — Router state: active, or one of the unavailable states the contract names
  (docs/contract.md, "Routes": the /ready reasons).
"""
