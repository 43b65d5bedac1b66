"""High availability: the router's own lease (one active router per key) and the states it puts the
router in.

* :mod:`.lease` — The router's own lease (one active router per lease key), judged on its own
  monotonic clock.
* :mod:`.redis_lease` — The lease backend on Redis: one atomic acquire-or-renew script.
* :mod:`.state` — Router state: active, or one of the unavailable states the contract names
  (docs/contract.md, "Routes": the /ready reasons).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "LeaseMode": "lease",
    "RedisLease": "redis_lease",
    "RouterLease": "lease",
    "RouterState": "state",
}
__all__ = [
    "LeaseMode", "RedisLease", "RouterLease", "RouterState",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.ha.lease import LeaseMode as LeaseMode
    from narwhal_serve.ha.redis_lease import RedisLease as RedisLease
    from narwhal_serve.ha.lease import RouterLease as RouterLease
    from narwhal_serve.ha.state import RouterState as RouterState
