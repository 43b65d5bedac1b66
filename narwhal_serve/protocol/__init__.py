"""The protocol: client requests validated and sized, and the plain types the layers above share.

* :mod:`.estimate` — The one characters-per-token estimate, for prompts the router cannot tokenize
  exactly.
* :mod:`.outcomes` — Terminal classes of an offered request (docs/contract.md, "Admission"); the
  values are the metric names' stems.
* :mod:`.placement` — What the scheduler hands the assembler: a placed request and its ordered
  candidate routes.
* :mod:`.requests` — Validation and sizing of client requests (the contract's validation rows,
  docs/contract.md, "Errors").
* :mod:`.stats` — What the router did for one finished request, as the relay measured it: read by
  the scheduler's models, the tenants' tallies, the request log and the ...
"""
