"""Admission: the contract's admission table, the one decision both the scheduler and the ingress
leases run, and the one ticket ledger after it (pure: no Ray, no I/O).

* :mod:`.controller` — The contract's admission table as one pure state machine.
* :mod:`.core` — The admission decision, one pure function that both holders run: the scheduler (for
  its queue) and every ingress replica (under its ...
* :mod:`.counters` — Global accounting: offered, unsized_offered and one terminal class per offered
  request.
* :mod:`.lease` — An ingress replica's admission lease: admit, refuse and place locally, with no
  scheduler call.
* :mod:`.ledger` — The bookkeeping after an admission decision: one copy, for the scheduler and the
  ingress lease.
* :mod:`.predictive` — The contract's two predictive rows: prompt alone over budget, projected TTFT
  over budget.
* :mod:`.retry` — Retry-After a client can trust: room kept for the clients told to come back.
* :mod:`.view` — What an admission decision is made on and what it returns: one engine's facts, a
  holder's own changes, the fleet view, the request's ask and the placement.
* :mod:`.wire` — What a lease and the scheduler tell each other across the Ray hop: the ingress's
  part of a report (its placements, permits in use and given back) and ...
"""
