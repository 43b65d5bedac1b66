"""GatewayApp: POSTs to the completion routes skip FastAPI's middleware, everything else does not;
an endpoint that raises still answers in the OpenAI envelope."""

from __future__ import annotations

import httpx
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from narwhal_serve.gateway.app import GatewayApp


def _app() -> GatewayApp:
    app = GatewayApp()
    calls: list[str] = []

    async def ok(request: Request) -> Response:
        calls.append(request.url.path)
        return JSONResponse({"body": (await request.body()).decode()})

    async def broken(request: Request) -> Response:
        raise RuntimeError("boom")

    app.fast = {"/v1/chat/completions": ok, "/v1/completions": broken}
    for path, endpoint in app.fast.items():
        app.add_route(path, endpoint, methods=["POST"])

    @app.middleware("http")
    async def mark(request: Request, call_next):  # type: ignore[no-untyped-def]
        response = await call_next(request)
        response.headers["x-through-fastapi"] = "1"
        return response

    app.state.calls = calls
    return app


async def test_completion_posts_take_the_fast_path_and_the_rest_fastapi() -> None:
    app = _app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", content=b"hi")
        assert r.status_code == 200 and r.json() == {"body": "hi"} and "x-through-fastapi" not in r.headers
        r = await c.get("/v1/chat/completions")  # not a POST: FastAPI's routing, 405
        assert r.status_code == 405 and r.headers["x-through-fastapi"] == "1"
        r = await c.post("/v1/other")
        assert r.status_code == 404 and r.headers["x-through-fastapi"] == "1"
        r = await c.post("/v1/completions")
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "internal_error" and "RuntimeError" in r.json()["error"]["message"]
    assert app.state.calls == ["/v1/chat/completions"]


async def test_the_fast_path_matches_below_the_route_prefix() -> None:
    app = _app()
    transport = httpx.ASGITransport(app=app, root_path="/predictive")
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/predictive/v1/chat/completions", content=b"x")
        assert r.status_code == 200 and "x-through-fastapi" not in r.headers
