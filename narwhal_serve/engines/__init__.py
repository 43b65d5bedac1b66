"""Engines: how each kind of engine is asked for a completion (one module per dialect), and the HTTP,
SSE and /metrics plumbing to them.

* :mod:`.client` — HTTP calls to engines: one streamed completion, one JSON completion.
* :mod:`.dialect` — The dialect contract: how one kind of engine is asked for a completion.
* :mod:`.errors` — Engine-side failures, as the relay sees them.
* :mod:`.legs` — Opening the client-facing stream of one route: a single leg, or a P/D pair
  (docs/contract.md, "Engine dialects and token identity").
* :mod:`.metrics` — Reading the few vLLM /metrics lines a router needs (Prometheus text format).
* :mod:`.openai` — Plain OpenAI-compatible servers: no token IDs, no P/D.
* :mod:`.sglang` — SGLang dialect: P/D by bootstrap — the same body plus bootstrap fields to both
  legs at once.
* :mod:`.sse` — An incremental Server-Sent Events decoder that survives arbitrary chunk splits.
* :mod:`.vllm` — vLLM dialect (docs/contract.md, "Engine dialects and token identity"): token IDs on
  every chunk, P/D by the two-step kv_transfer_params protocol.
"""
