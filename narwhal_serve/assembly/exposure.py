"""What of an engine chunk the client may see (docs/contract.md, "Engine dialects and token identity").

:func:`expose` runs per chunk on the streaming hot path, so it mutates the chunk in place and returns
it: no copies.  ``kv_transfer_params`` / ``ec_transfer_params`` (disaggregated-serving internals) are
removed wherever they appear; the walk skips the bulky per-token arrays (logprobs, token ids), which
never hold them.  ``token_ids`` / ``prompt_token_ids`` are set to null unless the client asked for
``return_token_ids`` (as vLLM streams them to a client that did not: the router always asks for
them).  Everything else keeps the engine's shape, null-valued fields included.

Feed the *raw* chunk to :class:`~narwhal_serve.assembly.fold.Assembler` and the token checks before
exposing it: exposure may strip the IDs they need.
"""

from __future__ import annotations

from typing import Any

TRANSFER_KEYS = ("kv_transfer_params", "ec_transfer_params")
TOKEN_ID_KEYS = ("token_ids", "prompt_token_ids")
# Values never walked: large per-token arrays that cannot contain transfer params.
_SKIP = frozenset({"logprobs", "prompt_logprobs", "token_ids", "prompt_token_ids", "routed_experts",
                   "content", "text", "arguments"})


def _strip_transfer(obj: dict[str, Any]) -> None:
    for key in TRANSFER_KEYS:
        if key in obj:
            del obj[key]
    for key, value in obj.items():
        if key in _SKIP:
            continue
        if isinstance(value, dict):
            _strip_transfer(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    _strip_transfer(item)


def expose(chunk: dict[str, Any], *, return_token_ids: bool) -> dict[str, Any]:
    """Return ``chunk`` (mutated in place) as the client may see it."""
    _strip_transfer(chunk)
    if not return_token_ids:
        if "prompt_token_ids" in chunk:
            chunk["prompt_token_ids"] = None
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    if "token_ids" in choice:
                        choice["token_ids"] = None
                    if "prompt_token_ids" in choice:
                        choice["prompt_token_ids"] = None
    return chunk
