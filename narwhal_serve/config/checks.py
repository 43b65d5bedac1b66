"""Field checks shared by the config sections: a value an operator could mistype is refused at
start, naming the field, instead of breaking or being ignored at run time."""

from __future__ import annotations

from urllib.parse import urlsplit

ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


def engine_url(url: str) -> str:
    """An engine's base URL: http(s), a host, no query or fragment, not ending in ``/v1`` (the
    router adds the routes: ``/v1/chat/completions``, ``/health``, ``/metrics``)."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: the engine's base URL, http:// or https:// with a host (for example "
                         "http://10.0.0.5:8000)")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a base URL has no query or fragment")
    if parts.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"{url!r}: give the server's base URL without /v1 (the router adds /v1/... itself, "
                         "and reads /health and /metrics beside it)")
    return url


def zmq_endpoint(endpoint: str | None) -> str | None:
    """A ZMQ endpoint the router connects to (vLLM's ``--kv-events-config``)."""
    if endpoint is not None and not endpoint.startswith(ZMQ_TRANSPORTS):
        raise ValueError(f"{endpoint!r}: a ZMQ endpoint, tcp://HOST:PORT or ipc://PATH")
    return endpoint


def unique(names: list[str]) -> list[str]:
    """The names given more than once, sorted."""
    return sorted({n for n in names if names.count(n) > 1})
