"""Malformed input: a 400 in the OpenAI envelope with ``param`` — never a 500, never an engine call.

JSON that Python would parse but an engine or the Ray hop cannot carry (NaN / Infinity literals,
lone surrogates, extreme nesting) and header values the router forwards to every engine leg."""

from __future__ import annotations

import httpx
import pytest

from tests.fault.conftest import Fleet
from tests.fault.helpers import CHAT, COMPLETIONS, assert_envelope, assert_quiescent, delta, received
from tests.support.graph import status

MESSAGES = '"messages": [{"role": "user", "content": "hi"}]'
BASE = '"model": "narwhal-sim", ' + MESSAGES + ', "max_tokens": 2'


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (raw body, expected param; ... = present, any value)
BODIES: dict[str, tuple[str, object]] = {
    "nan_literal": ("{" + BASE + ', "temperature": NaN}', "temperature"),
    "infinity_literal": ("{" + BASE + ', "top_p": Infinity}', "top_p"),
    "minus_infinity_literal": ("{" + BASE + ', "temperature": -Infinity}', "temperature"),
    "number_overflowing_to_infinity": ("{" + BASE + ', "temperature": 1e999}', "temperature"),
    "lone_surrogate_in_content": ('{"model": "narwhal-sim", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
                                  "messages.0.content"),
    "lone_surrogate_in_model": ('{"model": "narwhal-\\ud800", ' + MESSAGES + "}", "model"),
    "lone_low_surrogate_in_a_stop_string": ("{" + BASE + ', "stop": ["\\udc00"]}', "stop.0"),
    "nesting_1000_levels": ("{" + BASE + ', "extra": ' + nested(1000) + "}", ...),
    "nesting_100000_levels": ("{" + BASE + ', "extra": ' + nested(100_000) + "}", ...),
    "nesting_500_levels": ("{" + BASE + ', "extra": ' + nested(500) + "}", ...),
    "nesting_990_levels_in_content": ('{"model": "narwhal-sim", "messages": [{"role": "user", "content": '
                                      + nested(990) + "}]}", ...),
    "truncated_json": ("{" + BASE + ', "temperature": 0.', ...),
    "not_an_object": ("[" + nested(3) + "]", ...),
}


@pytest.mark.parametrize("case", list(BODIES))
async def test_malformed_body_gets_a_400_envelope_with_param(fleet: Fleet, case: str) -> None:
    app = fleet.pair
    raw, param = BODIES[case]
    before, engines_before = await status(app.url), await received(app)
    paths = [CHAT, COMPLETIONS] if MESSAGES in raw else [CHAT]  # the same fault on both routes
    async with httpx.AsyncClient(timeout=30) as c:
        for path in paths:
            body = raw if path == CHAT else raw.replace(MESSAGES, '"prompt": "hi"')
            r = await c.post(app.url + path, content=body.encode("utf-8", "surrogatepass"),
                             headers={"Content-Type": "application/json"})
            err = assert_envelope(r, 400, "invalid_request")
            assert err["type"] == "invalid_request_error"
            if param is not ...:
                assert err["param"] == param, err
    snap = await assert_quiescent(app)
    n = len(paths)
    assert delta(before, snap) == {"offered": n, "invalid_requests": n, "invalid_requests/invalid_request": n}
    assert await received(app) == engines_before  # nothing reached an engine


@pytest.mark.parametrize("value", [b"req-\xc3\xa9t\xc3\xa9", b"req-\xff", b"req with spaces", b"x" * 129],
                         ids=["utf8", "latin1_byte", "spaces", "129_chars"])
async def test_unusable_request_id_header_gets_a_400_envelope(fleet: Fleet, value: bytes) -> None:
    """Bytes outside ASCII are answered by Narwhal's HAProxy rule (Ray Serve would decode the header
    as UTF-8 first: a plain-text 500 for a byte that is not UTF-8), and so is an id over 128
    characters (Serve's proxy would echo it whole), so they never reach the router and are not
    counted; the others get the router's own 400, counted invalid."""
    app = fleet.pair
    before, engines_before = await status(app.url), await received(app)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(app.url + CHAT, content=("{" + BASE + "}").encode(),
                         headers=[(b"Content-Type", b"application/json"), (b"X-Request-Id", value)])
    assert_envelope(r, 400, "invalid_request", param="x-request-id")
    snap = await assert_quiescent(app)
    assert len(r.headers.get("x-request-id", "")) <= 128
    if value.isascii() and len(value) <= 128:
        assert delta(before, snap) == {"offered": 1, "invalid_requests": 1, "invalid_requests/invalid_request": 1}
    else:
        assert delta(before, snap) == {}
    assert await received(app) == engines_before


@pytest.mark.parametrize(("method", "path", "code"), [("GET", "/v1/nope", 404), ("POST", "/v1/chat/completions/x", 404),
                                                      ("GET", CHAT, 405), ("PUT", COMPLETIONS, 405)],
                         ids=["unknown_route", "unknown_subpath", "get_on_chat", "put_on_completions"])
async def test_unknown_route_or_method_answers_in_the_envelope(fleet: Fleet, method: str, path: str, code: int) -> None:
    app = fleet.pair
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.request(method, app.url + path)
    err = assert_envelope(r, code, {404: "not_found", 405: "method_not_allowed"}[code])
    assert err["type"] == "invalid_request_error"
    await assert_quiescent(app)
