"""One local router (no Ray) in a process of its own, for tests that pause or kill a router:
``python -m tests.support.local_router_main '<args as JSON>'`` prints ``READY <router url>
<first sim url>`` once it serves, and runs until SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from tests.support.local_router import start_local_router


async def main(args: dict[str, object]) -> None:
    router = await start_local_router(args)
    print(f"READY {router.url} {router.sims[0].url}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await router.stop()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
