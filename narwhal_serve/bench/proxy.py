"""The bare baseline: a FastAPI/uvicorn + httpx pass-through proxy, one engine or round-robin.

No validation, no admission, no accounting: the body goes to the next upstream as it came and the
answer streams back chunk by chunk with its status and content type.  This is the "bare uvicorn +
httpx proxy" row of the design's hot-path budget, and with several upstreams the ``rr`` target.

    python -m narwhal_serve.bench.proxy --port 8300 --upstream http://127.0.0.1:8100 [--upstream ...]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

_HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                         "te", "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding"})
_PASS_BACK = ("content-type", "retry-after", "x-request-id")


def create_proxy_app(upstreams: Sequence[str], transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """A proxy app forwarding the completion routes to ``upstreams`` in turn.

    ``transport`` replaces the network (tests pass an ``httpx.ASGITransport`` over a simulator app).
    """
    if not upstreams:
        raise ValueError("at least one upstream is required")
    bases = [u.rstrip("/") for u in upstreams]
    turn = itertools.cycle(range(len(bases)))
    holder: dict[str, httpx.AsyncClient] = {}

    def client() -> httpx.AsyncClient:
        c = holder.get("c")
        if c is None:
            c = holder["c"] = httpx.AsyncClient(
                transport=transport,
                timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
            )
        return c

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        c = holder.pop("c", None)
        if c is not None:
            await c.aclose()

    app = FastAPI(title="narwhal-bench proxy", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        url = bases[next(turn)] + request.url.path
        c = client()
        try:
            upstream = await c.send(c.build_request("POST", url, content=body, headers=headers), stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": {"message": f"upstream: {type(exc).__name__}", "type": "upstream_error",
                                           "param": None, "code": "bad_gateway"}}, status_code=502)
        out_headers = {k: v for k in _PASS_BACK if (v := upstream.headers.get(k)) is not None}
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=out_headers,
                                 background=BackgroundTask(upstream.aclose))

    app.add_api_route("/v1/chat/completions", forward, methods=["POST"])
    app.add_api_route("/v1/completions", forward, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({"ready": True, "upstreams": bases})

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="narwhal-bench-proxy", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", action="append", required=True, help="engine base URL (repeat for round-robin)")
    ns = p.parse_args(argv)
    uvicorn.run(create_proxy_app(ns.upstream), host=ns.host, port=ns.port, log_level="warning",
                access_log=False, timeout_keep_alive=30)


if __name__ == "__main__":
    main()
