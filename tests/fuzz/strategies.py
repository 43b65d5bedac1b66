"""Shared hypothesis strategies and settings for the fuzz suite (issue 13).

Reproducibility: every fuzz test runs under :data:`FUZZ`, which sets ``derandomize=True`` (the
examples are a pure function of the test's source, so a CI failure replays bit for bit on any
machine) and ``database=None`` (nothing is remembered between runs, so a local run never drifts from
CI's).  Example counts are bounded per test so that the whole ``tests/fuzz`` directory stays well
under a minute and a half on two shared cores.

To fuzz harder locally (random, more examples): ``NARWHAL_FUZZ_RANDOM=1 NARWHAL_FUZZ_SCALE=20
pytest tests/fuzz``; a failure prints the ``@reproduce_failure`` blob to paste.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_SCALE = max(1, int(os.environ.get("NARWHAL_FUZZ_SCALE", "1")))
_RANDOM = os.environ.get("NARWHAL_FUZZ_RANDOM", "") not in ("", "0")

FUZZ = settings(
    derandomize=not _RANDOM,
    database=None,
    deadline=None,  # two shared cores: wall-clock deadlines would only add flakes
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture],
)


def examples(n: int) -> settings:
    """:data:`FUZZ` with ``n`` examples (times ``NARWHAL_FUZZ_SCALE``)."""
    return settings(FUZZ, max_examples=n * _SCALE)


# ---------------------------------------------------------------- text

LONE_SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
ODD_CHARS = st.sampled_from(["\x00", "\x7f", "\u2028", "\u2029", "\ufeff", "\ufffd", "\U0001F600", "é", "ß",
                             "\u0301", "\r", "\n", "\t", '"', "\\", "/", "'", "\U0010FFFF"])
UNICODE_TEXT = st.text(st.characters(codec="utf-8") | ODD_CHARS, max_size=12)  # codec: no surrogates
# Text that may hold lone surrogates: what a Python ``str`` can carry but UTF-8 cannot.
ANY_TEXT = st.text(st.characters() | ODD_CHARS | LONE_SURROGATES, max_size=12)

HUGE_INTS = st.sampled_from([2**31, 2**63, 2**64 + 1, -(2**63) - 1, 10**30, 10**300, -(10**300), 10**4000])
ANY_INT = st.integers() | HUGE_INTS | st.integers(-3, 5)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1.5])
FINITE_FLOAT = st.floats(allow_nan=False, allow_infinity=False)


# ---------------------------------------------------------------- JSON values

def json_values(*, strict: bool, max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON-ish value.  ``strict``: only what strict JSON and UTF-8 can carry (finite floats,
    no lone surrogates), else non-finite floats and lone surrogates too."""
    text = UNICODE_TEXT if strict else ANY_TEXT
    floats = FINITE_FLOAT if strict else ANY_FLOAT
    leaves = st.none() | st.booleans() | ANY_INT | floats | text
    return st.recursive(
        leaves,
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text, kids, max_size=4),
        max_leaves=max_leaves,
    )


# Raw JSON literals a parser may choke on: non-finite, overflowing, over-long, odd escapes.
ODD_LITERALS = st.sampled_from([
    "NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1E+309", "9" * 320 + ".0", "1e-999",
    "1" * 5000, "-" + "9" * 4301, "0.0e0", "-0", "1.7976931348623157e308", "2.2250738585072014e-308",
    '"\\ud800"', '"\\uDFFF"', '"\\ud83d\\ude00"', '"\\u0000"', '"\\x41"', '"a\\', "01", "+1", ".5", "1.",
    "true", "false", "null", "nul", "[]", "{}", "[", "{", '"', "", " ", "\ufeff", "\\", '"\\/"',
])


@st.composite
def json_text(draw: st.DrawFn, depth: int = 0) -> str:
    """JSON-shaped text (not always valid): nested containers, odd literals, escaped or raw unicode."""
    kind = draw(st.integers(0, 9 if depth < 4 else 5))
    if kind <= 2:
        return draw(ODD_LITERALS)
    if kind == 3:
        return json.dumps(draw(ANY_INT | ANY_FLOAT | st.booleans() | st.none()))
    if kind <= 5:
        return json.dumps(draw(ANY_TEXT), ensure_ascii=draw(st.booleans()))
    if kind <= 7:
        items = draw(st.lists(json_text(depth + 1), max_size=3))
        return "[" + ",".join(items) + "]"
    keys = draw(st.lists(st.one_of(st.just('"model"'), st.just('"messages"'), st.just('"prompt"'),
                                   json_text(depth + 1)), max_size=3))
    vals = draw(st.lists(json_text(depth + 1), min_size=len(keys), max_size=len(keys)))
    return "{" + ",".join(f"{k}:{v}" for k, v in zip(keys, vals)) + "}"


def encode(text: str) -> bytes:
    """Text as bytes the way a careless client sends it: UTF-8, lone surrogates passed through."""
    return text.encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------- byte mutations

@st.composite
def mutated_bytes(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` with a few bytes flipped, deleted, inserted or a slice duplicated."""
    out = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 4))
        pos = draw(st.integers(0, len(out)))
        if op == 0 and pos < len(out):
            out[pos] = draw(st.integers(0, 255))
        elif op == 1 and pos < len(out):
            del out[pos : pos + draw(st.integers(1, 8))]
        elif op == 2:
            out[pos:pos] = draw(st.binary(min_size=1, max_size=6) | st.sampled_from(
                [b"\xed\xa0\x80", b"\\ud800", b"NaN", b"1e999", b"\x00", b"\xff", b"[", b"{", b'"', b"\r\n"]))
        elif op == 3:
            end = draw(st.integers(pos, len(out)))
            out[pos:pos] = out[pos:end]
        else:
            del out[pos:]
    return bytes(out)


def splits(data: st.DataObject, raw: bytes, max_cuts: int = 8) -> list[bytes]:
    """``raw`` cut at any positions (empty pieces allowed)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=max_cuts), label="cuts"))
    bounds = [0, *cuts, len(raw)]
    return [raw[a:b] for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------- strict-JSON checks

def assert_strict_json(value: Any) -> bytes:
    """``value`` as strict JSON (no NaN/Infinity) in valid UTF-8: what a client or an engine can read."""
    return json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")


def assert_envelope(body: Any) -> None:
    """The OpenAI error envelope, exactly (docs/contract.md, "Errors")."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert isinstance(err["code"], str) and err["code"]
    assert err["param"] is None or isinstance(err["param"], str)
