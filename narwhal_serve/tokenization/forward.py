"""Sending the engine the prompt's token IDs the router already has (docs/contract.md, "Tokenization").

The router tokenizes every text prompt exactly as the engine does, to size it; the engine then
tokenizes it again — for a long prompt tens of milliseconds on the engine's API server, on every
request's path to its first token.  A vLLM engine takes the IDs instead: a completion's ``prompt``
as a list of token IDs, a chat's as ``kv_transfer_params.prompt_token_ids`` (vLLM ≥ 0.32 feeds
those to the model without rendering the messages again; the key is what its P/D decode side
uses).  The answer is the same; only the engine's second tokenization is gone.

Sending IDs makes the router's tokenization what the model reads, so it is trusted only where it
has been seen to agree: each engine's first :data:`VERIFY_FIRST` requests of a route go as text,
and the ``prompt_token_ids`` the engine answers with must equal the router's own; after that one
request in :data:`RECHECK_EVERY` still goes as text and is checked again.  A disagreement stops
sending IDs to that engine for the life of the process, and is logged with its request.  The
check runs whatever the mode (``off`` included): it is how an operator learns that the router's
tokenizer is not the engine's.

Never sent as IDs: an ``echo`` request (the engine echoes the text it was sent), a route whose
engine's dialect takes no IDs, a prompt the router did not tokenize itself (token IDs from the
client, an estimate).  Chat forwarding (mode ``all``) needs vLLM ≥ 0.32; ``completions`` (the
default) works with any vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from narwhal_serve.protocol.requests import ParsedRequest

log = logging.getLogger("narwhal.tokenization")

ForwardMode = Literal["off", "completions", "all"]
VERIFY_FIRST = 8  # agreements an engine shows before it gets IDs
RECHECK_EVERY = 64  # of the requests it would get as IDs, one in this many goes as text, checked


@dataclass
class _Engine:
    agreed: int = 0  # requests sent as text whose IDs the engine confirmed
    forwarded: int = 0  # requests sent as IDs
    passes: int = 0  # requests that could have gone as IDs (counts the rechecks)
    disagreed: str | None = None  # the request that showed the first disagreement


class PromptIdForwarding:
    """Per process and engine: whether a request goes to its engine as the router's token IDs."""

    def __init__(self, mode: ForwardMode = "completions") -> None:
        self.mode = mode
        self._engines: dict[str, _Engine] = {}

    def wanted(self, req: ParsedRequest) -> bool:
        """Whether ``req`` is one the mode sends as IDs (once its engine is trusted)."""
        if req.own_ids is None or self.mode == "off" or req.body.get("echo") is True:
            return False
        return req.route == "completion" or self.mode == "all"

    def choose(self, engine: str, takes_ids: bool, req: ParsedRequest) -> tuple[int, ...] | None:
        """The IDs to send ``engine`` for ``req`` in place of its text, or None (send the text)."""
        if not takes_ids or not self.wanted(req):
            return None
        e = self._engines.setdefault(engine, _Engine())
        if e.disagreed is not None or e.agreed < VERIFY_FIRST:
            return None
        e.passes += 1
        if e.passes % RECHECK_EVERY == 0:
            return None  # this one goes as text: the engine's IDs are checked again
        e.forwarded += 1
        return req.own_ids

    def observed(self, engine: str, request_id: str, req: ParsedRequest, engine_ids: list[int] | None) -> bool | None:
        """The engine answered a request sent as text with ``engine_ids`` as its prompt: whether they
        are the router's own (None: nothing to compare)."""
        if req.own_ids is None or engine_ids is None:
            return None
        e = self._engines.setdefault(engine, _Engine())
        if len(engine_ids) == len(req.own_ids) and tuple(engine_ids) == req.own_ids:
            e.agreed += 1
            return True
        if e.disagreed is None:
            e.disagreed = request_id
            at = next((i for i, (a, b) in enumerate(zip(req.own_ids, engine_ids)) if a != b),
                      min(len(engine_ids), len(req.own_ids)))
            log.error("engine %s tokenized request %s (%s) otherwise than the router: %d prompt tokens against "
                      "the router's %d, first difference at token %d; its prompts go to it as text from now on "
                      "(check `tokenizer:` in the config)", engine, request_id, req.route, len(engine_ids),
                      len(req.own_ids), at)
        return False

    def status(self) -> dict[str, Any]:
        """For ``/status``: the mode, and per engine what was checked and sent."""
        return {"mode": self.mode, "engines": {
            name: {"agreed": e.agreed, "forwarded": e.forwarded, "disagreed": e.disagreed}
            for name, e in sorted(self._engines.items())}}
