"""Fault injection: which faults a request suffers and how they bend its chunks/body.

* Answer faults (``error_500``; ``error_429`` and ``error_503`` with a ``Retry-After`` of the
  engine's ``retry_after_s``) answer at once in vLLM's error envelope, before any generation.

* Stream faults (``hang_mid_stream``, ``reset_mid_stream``, ``malformed_sse``, ``error_mid_stream``: an
  error event with code 500, then ``[DONE]``, as vLLM ends a stream its engine failed) fire after
  ``fault_after`` SSE events have been sent (or just before ``[DONE]`` if the stream is shorter).
* Token faults (``bad_token_ids``, ``negative_token_ids``, ``unsupported_field``) hit the token chunk
  number ``min(fault_after, n - 1)`` (0-based); ``missing_token_ids`` hits every token chunk.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MALFORMED_EVENT = b"data: {not json\n\n"
# vLLM's answer to an engine error after the stream began: an error event, then [DONE]
ERROR_EVENT = (b'data: {"error": {"object": "error", "message": "Simulated engine failure (fault error_mid_stream)", '
               b'"type": "InternalServerError", "param": null, "code": 500}}\n\n')


class SimulatedReset(Exception):
    """Raised inside a streaming body to make the server drop the connection mid-stream."""


@dataclass(frozen=True)
class FaultPlan:
    names: frozenset[str]
    after: int = 2

    @classmethod
    def of(cls, engine_faults: Iterable[str], request_faults: Iterable[str], after: int) -> FaultPlan:
        return cls(frozenset(engine_faults) | frozenset(request_faults), after)

    def has(self, name: str) -> bool:
        return name in self.names

    def token_target(self, n_steps: int) -> int:
        return max(0, min(self.after, n_steps - 1))


def corrupt_stream_choice(choice: dict[str, Any], plan: FaultPlan, is_target: bool, chat: bool) -> None:
    """Apply token faults to one token chunk's choice (in place)."""
    if plan.has("missing_token_ids"):
        choice.pop("token_ids", None)
    if not is_target:
        return
    if plan.has("bad_token_ids"):
        choice["token_ids"] = [True]
    if plan.has("negative_token_ids"):
        choice["token_ids"] = [-1]
    if chat and plan.has("unsupported_field"):
        choice["delta"]["audio"] = {"id": "x"}


def corrupt_body(body: dict[str, Any], plan: FaultPlan, n_steps: int, chat: bool) -> None:
    """Apply token faults and ``missing_usage`` to a non-stream body (in place)."""
    choice = body["choices"][0]
    target = plan.token_target(n_steps)
    if plan.has("missing_token_ids"):
        choice.pop("token_ids", None)
    for name, value in (("bad_token_ids", True), ("negative_token_ids", -1)):
        if plan.has(name):
            ids = list(choice.get("token_ids") or [0] * n_steps)
            ids[target] = value
            choice["token_ids"] = ids
    if chat and plan.has("unsupported_field"):
        choice["message"]["audio"] = {"id": "x"}
    if plan.has("missing_usage"):
        body["usage"] = None
