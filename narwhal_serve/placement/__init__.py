"""Placement: which engines may take a request, how loaded each is, and the ordered candidate routes.

* :mod:`.drift` — Drift: an engine measured slower than its own models, scored, penalized, taken out
  and re-measured.
* :mod:`.engines` — What the scheduler knows about each engine, and which engines may take a
  request.
* :mod:`.health` — Passive health of one engine: a circuit breaker fed by the outcome of real
  attempts, and a backpressure window fed by the engine's own 429/503 ...
* :mod:`.picker` — Placement: eligibility filter → load score in [0, 1] → ordered candidate routes.
* :mod:`.prefix` — Prefix-aware placement: which engine already holds a request's prompt prefix (its
  KV blocks).
"""
