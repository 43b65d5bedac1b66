"""Fuzz: the HTTP routes end to end, without Ray (issue 13).

One in-process router for the module (``tests/support/local_router.py``: simulated engines, the
scheduler, the gateway app on uvicorn; predictive admission, ingress leases, an API key, a 64 KiB
body limit, a P/D pair and a unified engine).  Hypothesis sends it requests, one to three at a time:

* bodies: valid bodies, valid bodies with fields mutated to hostile values (wrong types, huge and
  non-finite numbers, lone surrogates escaped or raw), JSON-ish text, garbage bytes, byte-mutated
  bodies, deep nesting, bodies over the limit, empty bodies; sent with a Content-Length or chunked;
* headers: X-Request-Id (valid, too long, spaces, non-ASCII bytes, repeated), X-Request-Timeout /
  X-Stainless-Timeout / X-TTFT-Target (numbers, zero, negative, nan, inf, tiny, huge, words),
  Authorization (right, wrong, missing), Content-Type variants, traceparent;
* sometimes the client hangs up after the first bytes of a stream;
* other paths and methods (unknown routes, 405s, admin routes without a token, HEAD/OPTIONS...).

Properties, per example: no 5xx at all (these sims are healthy), except a 504 ``deadline_expired``
for a request that itself asked for a sub-second timeout; every non-2xx answer is exactly the
OpenAI envelope; a 200 is a strict-JSON completion or an SSE stream of strict-JSON events ending
with ``data: [DONE]``; a valid X-Request-Id comes back; and afterwards, at quiescence, the
router's counters balance (every offered request reached exactly one terminal class, and each
completion POST was offered exactly once), no gauge or lease permit is held, and the engines run
nothing.

Settings: see ``tests/fuzz/strategies.py`` (derandomized, no example database, bounded counts).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz.strategies import (
    ANY_TEXT,
    UNICODE_TEXT,
    assert_envelope,
    encode,
    examples,
    json_text,
    json_values,
    mutated_bytes,
)
from tests.support.local_router import LocalRouter, start_local_router

MODEL = "narwhal-sim"
KEY = "k-fuzz"
LIMIT = 65_536
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
FAST = {"prefill_overhead_s": 0.0005, "prefill_per_token_s": 0.00001, "tpot_base_s": 0.0002, "tpot_per_running_s": 0.0}


class Router:
    """The module's router, with a short repr (hypothesis prints a failing example's arguments)."""

    def __init__(self, r: LocalRouter) -> None:
        self.r = r

    def __repr__(self) -> str:
        return f"Router({self.r.url})"


@pytest.fixture(scope="module")
async def router() -> AsyncIterator[Router]:
    r = await start_local_router({
        "admission": {"mode": "predictive"},
        "serving": {"api_keys": [KEY], "max_request_bytes": LIMIT, "body_timeout_s": 10.0},
        "sim": {"engines": [{"name": "fz-prefill", "role": "prefill", **FAST},
                            {"name": "fz-decode", "role": "decode", **FAST},
                            {"name": "fz-unified", "role": "unified", **FAST}]},
    })
    try:
        yield Router(r)
    finally:
        await r.stop()


# ---------------------------------------------------------------- bodies

def _msgs() -> st.SearchStrategy[list[dict[str, Any]]]:
    return st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                           "content": UNICODE_TEXT}), min_size=1, max_size=2)


_opts = {"stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
         "return_token_ids": st.booleans(), "temperature": st.floats(0, 2), "seed": st.integers(0, 2**31),
         "stop": UNICODE_TEXT, "min_tokens": st.integers(0, 3), "ignore_eos": st.booleans()}
CHAT_BODY = st.fixed_dictionaries({"model": st.just(MODEL), "messages": _msgs(), "max_tokens": st.integers(1, 6)},
                                  optional={**_opts, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3)})
CMPL_BODY = st.fixed_dictionaries({"model": st.just(MODEL),
                                   "prompt": UNICODE_TEXT | st.lists(st.integers(0, 500), min_size=1, max_size=4),
                                   "max_tokens": st.integers(1, 6)}, optional={**_opts, "logprobs": st.integers(0, 3)})
HOSTILE = json_values(strict=False, max_leaves=8) | st.sampled_from(
    [float("nan"), float("inf"), 10**30, -1, 0, 1.5, True, "\ud800", "", [], {}, 10**4000])
FIELDS = st.sampled_from(["model", "messages", "prompt", "stream", "max_tokens", "min_tokens", "temperature", "seed",
                          "stop", "stream_options", "n", "best_of", "return_token_ids", "logprobs", "top_logprobs",
                          "echo", "max_completion_tokens", "tools", "modalities", "audio", "user",
                          "kv_transfer_params", "stream_interval", "bootstrap_room"]) | ANY_TEXT


@st.composite
def body_for(draw: st.DrawFn, path: str) -> bytes:
    valid: dict[str, Any] = draw(CHAT_BODY if path == CHAT else CMPL_BODY)
    if valid.get("stream_options") and not valid.get("stream"):  # (refused without stream, as OpenAI and vLLM do)
        valid["stream"] = True
    kind = draw(st.sampled_from(["valid"] * 6 + ["mutated"] * 5 + ["unicode"] * 2
                                + ["other-route", "text", "bytes", "byte-mutated", "deep", "huge", "empty"]))
    ascii_ = draw(st.booleans())
    if kind == "valid":
        return json.dumps(valid, ensure_ascii=ascii_).encode()
    if kind == "other-route":
        return json.dumps(draw(CMPL_BODY if path == CHAT else CHAT_BODY)).encode()
    body: dict[str, Any]
    if kind == "mutated":
        body = copy.deepcopy(valid)
        for _ in range(draw(st.integers(1, 3))):
            key = draw(FIELDS)
            if draw(st.integers(0, 4)) == 0:
                body.pop(key, None)
            else:
                body[key] = copy.deepcopy(draw(HOSTILE))
        body.pop("sim", None)  # the simulator's own fault-injection hook: not the router's input
        return encode(json.dumps(body, ensure_ascii=ascii_))
    if kind == "unicode":  # a string anywhere a client puts one, with a lone surrogate or other edge
        body = copy.deepcopy(valid)
        bad = draw(st.sampled_from(["\ud800", "a\udfffb", "\udbff", "\x00", "\u2028", "\ufeff", "\U0010ffff"]))
        where = draw(st.sampled_from(["model", "user", "stop", "content", "role", "key", "prompt"]))
        if where == "key":
            body[bad] = "x"
        elif where in ("content", "role") and "messages" in body:
            body["messages"][0][where] = bad
        elif where == "prompt" and "prompt" in body:
            body["prompt"] = [bad]
        else:
            body[where] = bad
        return encode(json.dumps(body, ensure_ascii=ascii_))
    if kind == "text":
        return encode(draw(json_text()))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "byte-mutated":
        return draw(mutated_bytes(json.dumps(valid, ensure_ascii=ascii_).encode()))
    if kind == "deep":
        depth = draw(st.sampled_from([63, 64, 65, 1000, 30_000]))
        return b'{"model": "narwhal-sim", "prompt": "x", "messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "huge":
        n = draw(st.sampled_from([LIMIT - 200, LIMIT + 1, 3 * LIMIT]))
        body = dict(valid)
        body["user"] = "x" * n
        return json.dumps(body).encode()
    return draw(st.sampled_from([b"", b" ", b"\n", b"{}", b"null"]))


# ---------------------------------------------------------------- headers

def _latin1(s: str) -> bytes:
    return s.encode("latin-1", "replace")


PRINTABLE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
# Header values that survive HTTP/1.1 framing (no control characters but tab, no DEL, no edge
# whitespace; obs-text bytes 0x80-0xFF are fine): what reaches the app rather than uvicorn's own 400.
HEADER_TEXT = st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f")
                      | st.sampled_from([" ", "\t"]),
                      min_size=1, max_size=40).map(str.strip).filter(bool)
SECONDS = st.sampled_from(["0", "-1", "nan", "NaN", "inf", "-inf", "1e-300", "1e309", "abc", "5", "0.5", "3600",
                           "1_0", "0x10", "1e3", "١٢", "+2", "00000", "1" * 400]) | HEADER_TEXT
REQUEST_IDS = PRINTABLE | st.sampled_from(["a" * 128, "a" * 129, "two words", "é", "ü-id", "id\x80", "日本"]) | HEADER_TEXT
CONTENT_TYPES = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                 "application/json; charset=utf-16", "*/*", "ü"])


@st.composite
def headers(draw: st.DrawFn) -> tuple[list[tuple[bytes, bytes]], str | None, float | None]:
    """(headers, the valid request id sent or None, the shortest timeout asked for or None)."""
    out: list[tuple[bytes, bytes]] = []
    if draw(st.booleans()):  # half the calls: only headers a good client sends
        out.append((b"authorization", f"Bearer {KEY}".encode()))
        rid = draw(st.none() | PRINTABLE)
        if rid is not None:
            out.append((b"x-request-id", rid.encode()))
        for name, v in (("x-request-timeout", "30"), ("x-ttft-target", "10"), ("content-type", "application/json")):
            if draw(st.booleans()):
                out.append((name.encode(), v.encode()))
        return out, rid, None
    auth = draw(st.sampled_from(["ok"] * 8 + ["missing", "wrong", "basic", "no-scheme"]))
    if auth != "missing":
        value = {"ok": f"Bearer {KEY}", "wrong": "Bearer nope", "basic": "Basic azpr", "no-scheme": KEY}[auth]
        out.append((b"authorization", value.encode()))
    rid = None
    if draw(st.booleans()):
        given_ids = draw(st.lists(REQUEST_IDS, min_size=1, max_size=2))
        out += [(b"x-request-id", _latin1(i)) for i in given_ids]
        rid = given_ids[0]
    timeouts: list[float] = []
    for name in ("x-request-timeout", "x-stainless-timeout", "x-ttft-target"):
        if draw(st.integers(0, 3)) == 0:
            v = draw(SECONDS)
            out.append((name.encode(), _latin1(v)))
            if name != "x-ttft-target":
                try:
                    timeouts.append(float(v))
                except ValueError:
                    pass
    if draw(st.integers(0, 3)) == 0:
        out.append((b"content-type", _latin1(draw(CONTENT_TYPES))))
    if draw(st.integers(0, 5)) == 0:
        out.append((b"traceparent", _latin1(draw(HEADER_TEXT | st.just("00-" + "0" * 32 + "-" + "0" * 16 + "-01")))))
    shortest = min(timeouts) if timeouts else None
    return out, rid, shortest


# ---------------------------------------------------------------- requests and checks

@dataclass
class Call:
    method: str
    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]]
    rid: str | None = None
    shortest_timeout: float | None = None
    chunked: bool = False
    hang_up: bool = False

    @property
    def completion_post(self) -> bool:
        return self.method == "POST" and self.path.split("?")[0] in (CHAT, CMPL)


@st.composite
def completion_call(draw: st.DrawFn) -> Call:
    path = draw(st.sampled_from([CHAT, CMPL]))
    hdrs, rid, shortest = draw(headers())
    return Call("POST", path, draw(body_for(path)), hdrs, rid, shortest,
                chunked=draw(st.integers(0, 3)) == 0, hang_up=draw(st.integers(0, 9)) == 0)


async def _chunks(body: bytes, n: int) -> AsyncIterator[bytes]:
    step = max(1, len(body) // n)
    for i in range(0, len(body), step):
        yield body[i : i + step]


def strict_loads(raw: bytes) -> Any:
    def no_constant(name: str) -> Any:
        raise AssertionError(f"{name} in a response body")

    return json.loads(raw.decode("utf-8"), parse_constant=no_constant)


def _sse_events(data: bytes) -> list[bytes]:
    assert data.endswith(b"\n\n"), data[-120:]
    out = []
    for event in data[:-2].split(b"\n\n"):
        lines = [ln for ln in event.split(b"\n") if ln and not ln.startswith(b":")]  # empty lines: keep-alives
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith(b"data: "), event[:120]
        out.append(lines[0][6:])
    return out


def _may_expire(call: Call) -> bool:
    """A 504 deadline_expired is the right answer for a request that asked for almost no time."""
    return call.shortest_timeout is not None and 0 < call.shortest_timeout < 2.0


async def send(client: httpx.AsyncClient, call: Call) -> None:
    content: Any = _chunks(call.body, 3) if call.chunked and call.body else call.body
    req = client.build_request(call.method, call.path, content=content, headers=call.headers)
    try:
        resp = await client.send(req, stream=True)
    except (httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError):
        if len(call.body) > LIMIT:  # refused (413) and closed while the client was still uploading
            return
        raise
    try:
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if call.hang_up and resp.status_code == 200 and sse:
            async for _ in resp.aiter_raw():
                break  # the client leaves mid-stream
            return
        data = await resp.aread()
    finally:
        await resp.aclose()
    check_response(call, resp, data)


def check_response(call: Call, resp: httpx.Response, data: bytes) -> None:
    status = resp.status_code
    event(f"{call.method} {'completion' if call.completion_post else 'other'} -> {status}")
    where = f"{call.method} {call.path} -> {status}: {data[:300]!r}"
    if status >= 500:
        assert status == 504 and _may_expire(call), where
    if status >= 400:
        if call.method != "HEAD":
            body = strict_loads(data)
            assert_envelope(body)
            if status == 504:
                assert body["error"]["code"] == "deadline_expired", where
    elif 300 <= status < 400:
        assert "location" in resp.headers, where  # e.g. a trailing-slash redirect
    if not call.completion_post:
        return
    if call.rid is not None and resp.headers.get("x-request-id") is not None and status < 500:
        ok_id = call.rid.isascii() and call.rid.isprintable() and " " not in call.rid and 1 <= len(call.rid) <= 128
        if ok_id and status == 200:
            assert resp.headers["x-request-id"] == call.rid, where
    if status != 200:
        return
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = _sse_events(data)
        assert events and events[-1] == b"[DONE]", where
        for e in events[:-1]:
            obj = strict_loads(e)
            assert isinstance(obj, dict), where
            if "error" in obj:  # a failure after headers: only the deadline this request asked for
                assert_envelope(obj)
                assert obj["error"]["code"] == "deadline_expired" and _may_expire(call), where
            else:
                assert obj.get("model") == MODEL, where
    else:
        obj = strict_loads(data)
        assert isinstance(obj, dict) and isinstance(obj.get("choices"), list) and obj["model"] == MODEL, where
        assert isinstance(obj.get("usage"), dict), where


async def quiescent(r: LocalRouter, offered_before: int, posts: int) -> None:
    """Wait (bounded) until nothing is in flight; then the books must balance exactly."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 15.0
    while True:
        await r.app_reporter.flush()
        snap = r.svc.snapshot()
        c, g = snap["counters"], snap["gauges"]
        terminal = sum(c[k] for k in ("completed", "failed", "rejected", "refused", "invalid_requests", "expired",
                                      "cancelled"))
        leases_idle = all(not any(lease["in_use"].values()) and lease["tickets"] == 0
                          for lease in snap["admission_leases"])
        engines_idle = all(s.engine.stats()["running"] == 0 and s.engine.stats()["waiting"] == 0 for s in r.sims)
        settled = c["offered"] == terminal and not any(g.values()) and leases_idle and engines_idle
        if settled and c["offered"] - offered_before == posts:
            return
        if loop.time() > end:
            raise AssertionError(
                f"not balanced at quiescence: offered {c['offered']} (+{c['offered'] - offered_before}, "
                f"{posts} posted) vs terminal {terminal}; counters {c}; gauges {g}; "
                f"leases {snap['admission_leases']}; engines idle: {engines_idle}")
        await asyncio.sleep(0.02)


async def run_calls(router: Router, calls: list[Call]) -> None:
    r = router.r
    await r.app_reporter.flush()
    before = r.svc.snapshot()["counters"]["offered"]
    async with httpx.AsyncClient(base_url=r.url, timeout=httpx.Timeout(60.0)) as client:
        await asyncio.gather(*(send(client, c) for c in calls))
    await quiescent(r, before, sum(c.completion_post for c in calls))


# ---------------------------------------------------------------- tests

@examples(120)
@given(st.lists(completion_call(), min_size=1, max_size=3))
async def test_completion_routes(router: Router, calls: list[Call]) -> None:
    await run_calls(router, calls)


PATHS = st.sampled_from([CHAT, CMPL, "/v1/models", "/health", "/ready", "/status", "/metrics", "/admin/maintenance",
                         "/admin/engines", "/admin/state", "/", "/v1", "/v1/chat/completions/", "/v1/embeddings",
                         "/v1/completions/x", "/v1/chat/completions?x=1", "/%ff", "/..%2f",
                         "/v1/models/narwhal-sim"]) | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E,
                                                                             exclude_characters="#?"),
                                                               max_size=20).map(lambda s: "/" + s.lstrip("/"))
METHODS = st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "TRACE", "PURGE"])


@st.composite
def any_call(draw: st.DrawFn) -> Call:
    method, path = draw(METHODS), draw(PATHS)
    hdrs, rid, shortest = draw(headers())
    body = draw(body_for(CHAT if path != CMPL else CMPL)) if method in ("POST", "PUT", "PATCH", "DELETE") else b""
    return Call(method, path, body, hdrs, rid, shortest)


@examples(100)
@given(st.lists(any_call(), min_size=1, max_size=3))
async def test_any_path_any_method(router: Router, calls: list[Call]) -> None:
    await run_calls(router, calls)
