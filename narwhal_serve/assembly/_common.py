"""Small validation helpers shared by the assembly modules (pure, no I/O).

Every failure raises :class:`~narwhal_serve.errors.BadEngineResponse` (HTTP 502) whose ``param`` is the
dotted JSON path of the offending field inside the engine frame, e.g. ``choices.0.delta.audio``.
"""

from __future__ import annotations

from typing import Any, NoReturn, TypeGuard

from narwhal_serve.errors import BadEngineResponse


def bad(message: str, param: str | None) -> NoReturn:
    raise BadEngineResponse(message, param=param)


def join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def is_int(value: object) -> TypeGuard[int]:
    """A JSON integer: ``bool`` is *not* an integer here."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def carries_value(value: object) -> bool:
    """Whether a field carries a value: null, ``""``, ``[]`` and ``{}`` carry none."""
    if value is None:
        return False
    if isinstance(value, (str, list, dict)):
        return len(value) > 0
    return True


def reject_unknown(obj: dict[str, Any], known: frozenset[str], path: str) -> None:
    """502 for any key outside ``known`` that carries a value; null/empty unknown keys pass."""
    for key, value in obj.items():
        if key not in known and carries_value(value):
            bad(f"Engine sent unsupported field {join(path, key)}", join(path, key))


def opt_str(obj: dict[str, Any], key: str, path: str) -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    bad(f"Engine field {join(path, key)} must be a string", join(path, key))


def opt_dict(obj: dict[str, Any], key: str, path: str) -> dict[str, Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, dict):
        return value
    bad(f"Engine field {join(path, key)} must be an object", join(path, key))


def opt_list(obj: dict[str, Any], key: str, path: str) -> list[Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, list):
        return value
    bad(f"Engine field {join(path, key)} must be an array", join(path, key))


def index_of(obj: dict[str, Any], path: str) -> int:
    """The required non-negative integer ``index`` of a choice or tool-call fragment."""
    value = obj.get("index")
    if not is_int(value) or value < 0:
        bad(f"Engine field {join(path, 'index')} must be a non-negative integer", join(path, "index"))
    return value


def stop_reason_of(obj: dict[str, Any], path: str) -> str | int | None:
    """vLLM's ``stop_reason``: the matched stop string, a stop token ID, or null."""
    value = obj.get("stop_reason")
    if value is None or isinstance(value, str) or is_int(value):
        return value
    bad(f"Engine field {join(path, 'stop_reason')} must be a string, an integer or null",
        join(path, "stop_reason"))

