"""Strict JSON for request bodies: what an engine or the Ray hop cannot carry (NaN, Infinity, a
number that overflows, a lone surrogate, nesting past MAX_NESTING) is refused at parse time with
the path of the field it is in (docs/contract.md, "Errors")."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from narwhal_serve.errors import InvalidRequest

MAX_NESTING = 64  # containers inside containers; deeper bodies are refused before they reach an engine
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# A surrogate sent raw: UTF-8 bytes ED A0..BF xx, which json.loads decodes with 'surrogatepass'.
_SURROGATE_RAW = re.compile(rb"\xed[\xa0-\xbf]")


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether ``raw`` may decode to a lone surrogate: escaped, sent as raw UTF-8 bytes, or in a
    UTF-16/32 body (which json.loads detects from the NUL bytes in its first four bytes)."""
    return (
        _SURROGATE_ESCAPE.search(raw) is not None
        or (b"\xed" in raw and _SURROGATE_RAW.search(raw) is not None)
        or b"\x00" in raw[:4]
    )


class _NotFinite:
    """A number JSON cannot carry to an engine (``1e400``, ``NaN``, ``Infinity``), kept in place by the
    parser so the walk that follows can name the field it is in."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text[:40]


def _finite(text: str) -> float | _NotFinite:
    f = float(text)
    return f if math.isfinite(f) else _NotFinite(text)


def _no_constant(name: str) -> _NotFinite:
    return _NotFinite(name)


def _check_key(key: str, path: str) -> None:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("a key is not valid Unicode (a lone surrogate)", param=path.encode("utf-8", "replace").decode()) from None


def _walk(value: Any, check_strings: bool) -> None:
    """Nesting depth (and, when asked, strings that are not valid Unicode), with the failing path."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, dict):
            items: Any = v.items()
        elif isinstance(v, list):
            items = enumerate(v)
        else:
            if isinstance(v, _NotFinite):
                what = "is not a JSON number" if v.text in ("NaN", "Infinity", "-Infinity") else "is out of range"
                raise InvalidRequest(f"'{path}': {v.text} {what}" if depth else f"{v.text} {what}",
                                     param=path if depth else None)
            if check_strings and isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    msg = f"'{path}' is not valid Unicode (a lone surrogate)"
                    raise InvalidRequest(msg, param=path if depth else None) from None
            continue
        if depth >= MAX_NESTING:
            msg = f"the body nests deeper than {MAX_NESTING} levels"
            raise InvalidRequest(msg, param=path[:200] if depth else None)
        for k, child in items:
            child_path = f"{path}.{k}" if depth else str(k)  # (not `if path`: a key may be "")
            if check_strings and isinstance(k, str):
                _check_key(k, child_path)
            stack.append((child, child_path, depth + 1))


def decode_json(raw: bytes) -> dict[str, Any]:
    """Strict JSON: no NaN / Infinity, no number that overflows to infinity, valid Unicode only,
    at most MAX_NESTING levels — what an engine or the Ray hop cannot carry is refused here."""
    if not raw.strip():
        raise InvalidRequest("request body is empty; expected a JSON object", param=None)
    try:
        body = json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidRequest(f"the body nests deeper than {MAX_NESTING} levels", param=None) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", param=None) from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", param=None)
    _walk(body, check_strings=_may_hold_surrogates(raw))
    return body
