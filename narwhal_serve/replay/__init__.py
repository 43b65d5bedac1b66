"""Capacity planning by replay: a request trace through the router's real admission on a virtual
clock, against simulated engines (docs/performance.md, "Capacity planning by replay";
``narwhal-bench replay`` is its command, in ``bench/replay.py``).

* :mod:`.vloop` — an asyncio event loop whose clock jumps to the next timer when nothing is ready.
* :mod:`.engine` — the simulator's engine taken in events (tokens counted between changes, not stepped).
* :mod:`.trace` — the traces it reads (Azure 2023, Mooncake FAST'25, Narwhal's own JSONL) and the
  token IDs and block hashes their prompts stand for.
* :mod:`.run` — one replay: the scheduler service, the ingress leases and the gateway's admission,
  unchanged, driving the engines.
"""
