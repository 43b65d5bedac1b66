"""The relay: attempts at candidate routes, the checked stream to the client, mid-stream resume.

* :mod:`.attempt` — One attempt at one route, and what the relay writes: the per-attempt state (its
  meter of token IDs and timing, the transcript a resume continues ...
* :mod:`.coalesce` — Coalescing an engine stream for the one streaming hop to the ingress.
* :mod:`.messages` — What the assembler sends the ingress over the one streaming hop: one message
  type.
* :mod:`.pipeline` — The assembler's work for one placed request: try candidate routes until one
  answers, then relay its stream (streaming clients) or fold it into one ...
* :mod:`.resume` — Mid-stream resume (docs/contract.md, "Engine failures"): what an answer cut after
  its first token needs to continue on another engine exactly where ...
"""
