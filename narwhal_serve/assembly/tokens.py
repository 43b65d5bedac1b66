"""Token identity checks on parsed engine SSE chunks (docs/contract.md, "Engine dialects and token identity").

Narwhal asks token-ID-capable engines for ``{"return_token_ids": true, "stream_interval": 1}`` on the
decode stream.  :func:`check_token_ids` then checks each chunk: every choice that carries generated
output (text/content, reasoning, reasoning_content, refusal, tool_calls or function_call) must carry
``token_ids``, a list of non-negative integers (``true``/``false`` are not IDs).  A present non-null
``token_ids`` is always checked, even when the decoded text is empty: vLLM sends e.g. ``content: ""``
with ``token_ids: [126]`` for a token that decodes to nothing.  The first chat chunk (role only,
``content: ""``) carries no IDs and is valid.
"""

from __future__ import annotations

from typing import Any, Literal

from ._common import bad, carries_value, is_int, join

Route = Literal["chat", "completion"]

# Fields whose non-empty value means "this event generated output".
CHAT_GENERATED = ("content", "reasoning", "reasoning_content", "refusal", "tool_calls", "function_call")
COMPLETION_GENERATED = ("text",)


def validate_ids(value: object, param: str) -> list[int]:
    """``value`` as a list of non-negative integers, or 502 naming ``param``."""
    if not isinstance(value, list):
        bad(f"Engine field {param} must be an array of token IDs", param)
    for pos, tok in enumerate(value):
        if not is_int(tok) or tok < 0:
            bad(f"Engine field {param} has an invalid token ID at position {pos}: {tok!r}", param)
    return value


def choices_of(chunk: dict[str, Any]) -> list[Any]:
    """The chunk's ``choices`` list (``[]`` when absent or null)."""
    if not isinstance(chunk, dict):
        bad("Engine frame is not a JSON object", None)
    choices = chunk.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list):
        bad("Engine field choices must be an array", "choices")
    return choices


def generates(choice: dict[str, Any], route: Route, path: str) -> bool:
    """Whether a choice event carries generated output (a non-empty generated field)."""
    if route == "chat":
        delta = choice.get("delta")
        if delta is None:
            return False
        if not isinstance(delta, dict):
            bad(f"Engine field {join(path, 'delta')} must be an object", join(path, "delta"))
        return any(carries_value(delta.get(key)) for key in CHAT_GENERATED)
    return carries_value(choice.get("text"))


def check_token_ids(chunk: dict[str, Any], route: Route) -> int:
    """Validate the token IDs of one parsed engine chunk; return how many IDs it carried.

    Raises :class:`BadEngineResponse` (param ``choices.<i>.token_ids``) when an event carrying generated
    output omits the list (absent or null), or when any present list is malformed (not a list, a
    Boolean, negative, float or non-integer ID).
    """
    total = 0
    for i, choice in enumerate(choices_of(chunk)):
        path = f"choices.{i}"
        if not isinstance(choice, dict):
            bad(f"Engine field {path} must be an object", path)
        param = join(path, "token_ids")
        ids = choice.get("token_ids")
        if ids is None:
            if generates(choice, route, path):
                bad(f"Engine event with generated output omitted {param} (the vllm dialect needs vLLM >= 0.10.2, "
                    "which returns token IDs when asked; an older engine is served as dialect openai)", param)
            continue
        total += len(validate_ids(ids, param))
    return total


def check_prompt_token_ids(chunk: dict[str, Any], route: Route) -> list[int] | None:
    """The prompt token IDs carried by ``chunk`` (validated), or ``None`` when it carries none.

    Chat engines send them at the top level of the first chunk; completion engines inside the choice.
    """
    if route == "chat":
        if not isinstance(chunk, dict):
            bad("Engine frame is not a JSON object", None)
        ids = chunk.get("prompt_token_ids")
        return None if ids is None else validate_ids(ids, "prompt_token_ids")
    found: list[int] | None = None
    for i, choice in enumerate(choices_of(chunk)):
        if not isinstance(choice, dict):
            bad(f"Engine field choices.{i} must be an object", f"choices.{i}")
        ids = choice.get("prompt_token_ids")
        if ids is not None:
            checked = validate_ids(ids, f"choices.{i}.prompt_token_ids")
            if found is None:
                found = checked
    return found
