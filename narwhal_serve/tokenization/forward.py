"""Sending the engine the prompt's token IDs the router already has (docs/contract.md, "Tokenization").

The router tokenizes every text prompt exactly as the engine does, to size it; the engine then
tokenizes it again — for a long prompt tens of milliseconds on the engine's API server, on every
request's path to its first token.  A vLLM engine takes the IDs instead: a completion's ``prompt``
as a list of token IDs, a chat's as ``kv_transfer_params.prompt_token_ids`` (vLLM ≥ 0.32 feeds
those to the model without rendering the messages again; the key is what its P/D decode side
uses).  The answer is the same; only the engine's second tokenization is gone.

Sending IDs makes the router's tokenization what the model reads, so it is trusted only where it
has been seen to agree, per engine and per *shape* of request (:func:`shape_of`: the route, the
fields that change how a prompt is rendered, the message roles, tool calls, content parts, the
prompt's length class): the first :data:`VERIFY_FIRST` requests of a shape to an engine go as
text, and the ``prompt_token_ids`` the engine answers with must equal the router's own.  After
that a request still goes as text, and is checked, at random one time in :data:`RECHECK_EVERY`,
and always when the shape's last agreement is older than :data:`TRUST_S`; an engine that could
not be reached starts over (it may have restarted otherwise).  A disagreement stops sending IDs
of that shape to that engine for the life of the process, and is logged with its request.  The
check runs whatever the mode (``off`` included): it is how an operator learns that the router's
tokenizer is not the engine's.

Never sent as IDs: an ``echo`` request (the engine echoes the text it was sent), a completion with
a ``suffix`` (the engine renders it with the prompt's text, or refuses it), an empty prompt, a
route whose engine's dialect takes no IDs, a prompt the router did not tokenize itself (token IDs
from the client, an estimate).  Chat forwarding (mode ``all``) needs vLLM ≥ 0.32;
``completions`` (the default) works with any vLLM.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from narwhal_serve.protocol.requests import ParsedRequest

log = logging.getLogger("narwhal.tokenization")

ForwardMode = Literal["off", "completions", "all"]
VERIFY_FIRST = 8  # agreements a shape shows on an engine before it goes there as IDs
RECHECK_EVERY = 64  # about one in this many requests that could go as IDs goes as text, checked
TRUST_S = 60.0  # a shape whose last agreement is older goes as text once more, checked
MAX_SHAPES = 4096  # shapes followed per process (past it, the least recently used that never disagreed goes)

# body fields that change how vLLM renders a prompt: their values (scalars) or presence (the rest)
_SCALAR_KEYS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "reasoning_effort",
                "tool_choice")
_PRESENT_KEYS = ("tools", "chat_template_kwargs", "documents", "mm_processor_kwargs", "response_format")

Shape = tuple[Any, ...]


def _value(v: Any) -> Any:
    """A rendering field's value as a shape holds it: booleans and strings as they are, anything
    else by its type too (``0``, ``1``, ``null`` and ``false`` are different shapes: ``0 == False``
    in Python, not to every reader of the field), a list or an object by its type alone."""
    if isinstance(v, (bool, str)):
        return v
    return (type(v).__name__, v if v is None or isinstance(v, (int, float)) else None)


def shape_of(req: ParsedRequest) -> Shape:
    """What a request's rendering depends on, besides its text: requests of one shape that agree
    with the engine vouch for each other, and for no other shape.  A rendering field sent with any
    value (``null`` included) is a different shape from the field left out."""
    body = req.body
    scalars = tuple((k, _value(body[k])) for k in _SCALAR_KEYS if k in body)
    present = tuple(k for k in _PRESENT_KEYS if body.get(k) is not None)
    n = len(req.own_ids or ())
    length = 0 if n < 256 else 1 if n < 4096 else 2
    if req.route != "chat":
        return (req.route, scalars, present, length)
    msgs = [m for m in body.get("messages") or () if isinstance(m, dict)]
    roles = tuple(sorted({str(m.get("role")) for m in msgs}))
    calls = any(m.get("tool_calls") for m in msgs)
    parts = any(isinstance(m.get("content"), list) for m in msgs)
    return (req.route, scalars, present, length, roles, calls, parts)


@dataclass
class _Trust:
    agreed: int = 0  # requests sent as text whose IDs the engine confirmed
    at: float = 0.0  # when the last one was
    forwarded: int = 0  # requests sent as IDs
    disagreed: str | None = None  # the request that showed the first disagreement


class PromptIdForwarding:
    """Per process, engine and shape: whether a request goes to its engine as the router's token IDs.
    ``now`` arguments are wall-clock seconds; ``rng`` decides the random rechecks."""

    def __init__(self, mode: ForwardMode = "completions", rng: random.Random | None = None,
                 max_shapes: int = MAX_SHAPES) -> None:
        self.mode = mode
        self._rng = rng or random.Random()
        self._max = max_shapes
        self._trust: OrderedDict[tuple[str, Shape], _Trust] = OrderedDict()  # least recently used first

    @staticmethod
    def plain(req: ParsedRequest) -> bool:
        """Whether ``req``'s prompt is one whose IDs could stand for its text (and so be checked)."""
        body = req.body
        return bool(req.own_ids) and body.get("echo") is not True and body.get("suffix") is None

    def wanted(self, req: ParsedRequest) -> bool:
        """Whether ``req`` is one the mode sends as IDs (once its engine is trusted with its shape)."""
        if self.mode == "off" or not self.plain(req):
            return False
        return req.route == "completion" or self.mode == "all"

    def _get(self, engine: str, shape: Shape) -> _Trust | None:
        """The shape's record on ``engine`` (made on first sight).  The table is bounded: a new shape
        past :data:`MAX_SHAPES` takes the place of the least recently used one that never disagreed
        (which starts over if it comes back), so a client sending ever new shapes costs other
        shapes their trust, never their checks; a disagreement is kept (None when every record is one)."""
        key = (engine, shape)
        t = self._trust.get(key)
        if t is not None:
            self._trust.move_to_end(key)
            return t
        if len(self._trust) >= self._max:
            old = next((k for k, v in self._trust.items() if v.disagreed is None), None)
            if old is None:
                return None
            del self._trust[old]
        t = self._trust[key] = _Trust()
        return t

    def choose(self, engine: str, takes_ids: bool, req: ParsedRequest, now: float) -> tuple[int, ...] | None:
        """The IDs to send ``engine`` for ``req`` in place of its text, or None (send the text)."""
        if not takes_ids or not self.wanted(req):
            return None
        t = self._get(engine, shape_of(req))
        if t is None or t.disagreed is not None or t.agreed < VERIFY_FIRST or now - t.at > TRUST_S:
            return None
        if self._rng.random() * RECHECK_EVERY < 1.0:
            return None  # this one goes as text: the engine's IDs are checked again
        t.forwarded += 1
        return req.own_ids

    def observed(self, engine: str, request_id: str, req: ParsedRequest, engine_ids: list[int] | None,
                 now: float) -> bool | None:
        """The engine answered a request sent as text with ``engine_ids`` as its prompt: whether they
        are the router's own (None: nothing to compare)."""
        if engine_ids is None or not self.plain(req):
            return None
        own = req.own_ids
        assert own is not None
        t = self._get(engine, shape_of(req))
        if t is None:
            return None
        if len(engine_ids) == len(own) and tuple(engine_ids) == own:
            t.agreed += 1
            t.at = now
            return True
        if t.disagreed is None:
            t.disagreed = request_id
            at = next((i for i, (a, b) in enumerate(zip(own, engine_ids)) if a != b), min(len(engine_ids), len(own)))
            log.error("engine %s tokenized request %s (%s) otherwise than the router: %d prompt tokens against the "
                      "router's %d, first difference at token %d; prompts of its shape go to it as text from now on "
                      "(check `tokenizer:` and the engine's rendering flags)", engine, request_id, req.route,
                      len(engine_ids), len(own), at)
        return False

    def forget(self, engine: str) -> None:
        """``engine`` could not be reached: it may come back otherwise (another model, other flags), so
        what it showed no longer counts."""
        for key in [k for k in self._trust if k[0] == engine]:
            if self._trust[key].disagreed is None:
                del self._trust[key]

    def status(self) -> dict[str, Any]:
        """For ``/status``: the mode, and per engine and route what was checked and sent."""
        engines: dict[str, dict[str, dict[str, Any]]] = {}
        for (engine, shape), t in sorted(self._trust.items(), key=lambda kv: kv[0][0]):
            row = engines.setdefault(engine, {}).setdefault(
                shape[0], {"shapes": 0, "agreed": 0, "forwarded": 0, "disagreed": []})
            row["shapes"] += 1
            row["agreed"] += t.agreed
            row["forwarded"] += t.forwarded
            if t.disagreed is not None:
                row["disagreed"].append(t.disagreed)
        return {"mode": self.mode, "engines": engines}
