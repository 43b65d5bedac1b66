"""The HTTP surface (docs/contract.md, "Routes"): completion routes, models, health, readiness, status, metrics, admin.

``build_api`` takes a :class:`Backend`, so the same app runs inside the Ray ingress and in-process.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from narwhal_serve.admission.lease import AdmissionLease
from narwhal_serve.tenants.shares import LeaseShares
from narwhal_serve.config import NarwhalConfig
from narwhal_serve.errors import ErrorInfo, InvalidApiKey, InvalidRequest, NarwhalError
from narwhal_serve.gateway.backend import Backend
from narwhal_serve.gateway.completion import CompletionHandler
from narwhal_serve.gateway.reporter import Reporter
from narwhal_serve.gateway.body import BodyIncomplete, read_body
from narwhal_serve.gateway.responses import BODY_INCOMPLETE, closing_after, error_response
from narwhal_serve.gateway.streaming import internal_error
from narwhal_serve.gateway.tokenize import detokenize, tokenize
from narwhal_serve.protocol.requests import model_not_found
from narwhal_serve.protocol.strictjson import decode_json
from narwhal_serve.tokenization.sizer import PromptSizer

log = logging.getLogger(__name__)

try:  # GET /version, as vLLM's names its own: this router's
    VERSION = importlib.metadata.version("narwhal-serve")
except importlib.metadata.PackageNotFoundError:  # run from a tree that was not installed
    VERSION = "unknown"


Endpoint = Callable[[Request], Awaitable[Response]]


class GatewayApp(FastAPI):
    """FastAPI, with the completion routes taken before its middleware stack: a POST to one of
    ``fast`` goes straight to its endpoint (its response, streamed, is then written through no
    middleware either), everything else through FastAPI.  Each middleware layer wraps every
    ``send`` of a stream, so on a streamed answer this is per token, not per request."""

    fast: dict[str, Endpoint]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast.get(_route_path(scope))
            if endpoint is not None:
                await _call_fast(endpoint, scope, receive, send)
                return
        if scope["type"] == "http" and scope["method"] == "HEAD":
            # HEAD is GET without the body (RFC 9110; FastAPI's GET routes answer it 405): load
            # balancers check /health so
            await super().__call__({**scope, "method": "GET"}, receive, _headless(send))
            return
        await super().__call__(scope, receive, send)


def _headless(send: Send) -> Send:
    """``send`` with every body dropped (its headers, Content-Length included, as for the GET)."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return sending


def _route_path(scope: Scope) -> str:
    """The path below the app's mount point (``root_path``: Serve's route prefix), as Starlette's
    router matches it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] == "/":
        return str(path[len(root):])
    return str(path)


async def _call_fast(endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
    started = False

    async def sending(message: Message) -> None:
        nonlocal started
        started = True
        await send(message)

    try:
        response = await endpoint(Request(scope, receive, send))
    except Exception as exc:  # the endpoint answers its own errors: this is a bug, still in the envelope
        log.exception("completion endpoint failed")
        response = error_response(internal_error(f"internal error: {type(exc).__name__}"), None)
    try:
        await response(scope, receive, sending)
    except Exception:
        if started:
            raise  # the stream is out: the server closes the connection
        log.exception("completion response failed before its headers")
        await error_response(internal_error("internal error"), None)(scope, receive, send)


def build_api(
    cfg: NarwhalConfig,
    backend: Backend,
    *,
    clock: Callable[[], float] = time.time,
    echo_request_id: bool = True,
    sizer: PromptSizer | None = None,
    node: str | None = None,
    stamp_key: str | None = None,
) -> GatewayApp:
    """``echo_request_id=False`` where a proxy in front (Ray Serve's) already returns X-Request-Id;
    ``node``: the Ray node this replica runs on (engines there win near-ties in placement);
    ``stamp_key``: HAProxy is in front and stamps each request's receipt with this key
    (runenv.RECEIVED_HEADER: only a stamp with it is believed)."""
    lease = AdmissionLease(f"ingress-{secrets.token_hex(6)}") if cfg.admission.ingress_leases else None
    if lease is not None and cfg.tenants is not None and any(t.budgeted() for t in cfg.tenants.list):
        lease.shares = LeaseShares(cfg.tenants.by_name())
    reporter = Reporter(backend.report, lease=lease, linger_s=cfg.admission.report_linger_s,
                        watch=backend.watch if cfg.admission.lease_watch else None)
    if lease is not None and (relay := backend.local_relay) is not None:
        relay.live_targets = lambda tokens: lease.resume_targets(clock(), tokens)  # where the fleet has room now
        relay.live_context = lease.context_of

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reporter.start()  # the lease's first grant, before the first request
        yield
        # Serve's only hook at a replica's stop (after its requests drained): what ended is told
        # (bounded: an unreachable scheduler does not hold the stop), then the parked watch ends
        await reporter.flush()
        await reporter.stop()

    # redirect_slashes off: Starlette answers `/v1/chat/completions/` with a 307 whose Location is
    # built from the client's Host header; here it is a 404 in the envelope like any unknown route
    app = GatewayApp(title="Narwhal", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                     redirect_slashes=False)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown routes and methods answer in the OpenAI envelope too."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        response = error_response(ErrorInfo(exc.status_code, "invalid_request_error", code, msg), None)
        allow = (exc.headers or {}).get("Allow")
        if exc.status_code == 405 and allow is not None:  # the methods the route takes (RFC 9110)
            methods = [m.strip() for m in allow.split(",")]
            if "GET" in methods and "HEAD" not in methods:  # (GatewayApp answers HEAD as GET)
                methods.append("HEAD")
            response.headers["Allow"] = ", ".join(methods)
        return response

    @app.exception_handler(Exception)
    async def route_failed(request: Request, exc: Exception) -> Response:
        """A fault of a route outside the completion routes (its backend call failed, a bug) still
        answers in the envelope (Starlette's would be a plain-text 500); the server logs it."""
        return error_response(internal_error(f"internal error: {type(exc).__name__}"), None)

    sizer = sizer if sizer is not None else PromptSizer.from_config(cfg)
    if (relay := backend.local_relay) is not None and (tok := sizer.tokenizer) is not None:
        relay.detokenize = tok.decode  # (where a resumed answer's cut character starts)
    handler = CompletionHandler(cfg, backend, reporter, clock, echo_request_id=echo_request_id, sizer=sizer, node=node,
                                 stamp_key=stamp_key)
    reporter.on_view = handler.on_view
    app.state.reporter = reporter
    created = int(clock())

    async def chat(request: Request) -> Response:
        return await handler.handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await handler.handle(request, "completion")

    # POSTs to the completion routes skip FastAPI (GatewayApp); as routes they answer other
    # methods (405 in the envelope)
    app.fast = {"/v1/chat/completions": chat, "/v1/completions": completions}
    for path, endpoint in app.fast.items():
        app.add_route(path, endpoint, methods=["POST"])

    def token_route(fn: Callable[[PromptSizer, str, bytes], Awaitable[dict[str, Any]]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            try:
                handler.tenancy.identify(request)
                raw = await read_body(request, cfg.serving.max_request_bytes, cfg.serving.body_timeout_s)
                out = await fn(sizer, cfg.model, raw)
                if "max_model_len" in out and (context := fleet_context()):
                    out["max_model_len"] = context  # the engines' own, as vLLM's /tokenize says its own
                return JSONResponse(out)
            except NarwhalError as err:
                return closing_after(err, error_response(err.info(), None))
            except BodyIncomplete:
                return error_response(InvalidRequest(BODY_INCOMPLETE, code="body_incomplete").info(), None)

        return route

    app.add_api_route("/tokenize", token_route(tokenize), methods=["POST"])
    app.add_api_route("/detokenize", token_route(detokenize), methods=["POST"])

    # `root` as vLLM sends it (where the model loads from: vLLM's is its --model): `vllm bench serve`
    # without --model reads data[0]["root"] and, without --tokenizer, loads its tokenizer from it; so
    # the tokenizer directory the router sizes prompts with (a managed engine's model directory), else
    # the served name
    # owned_by as vLLM's card says it where every engine is one (clients tell a vLLM server by it before
    # they use its extras: /tokenize, token IDs), else Narwhal's
    def owned_by(dialects: Iterable[str]) -> str:
        return "vllm" if all(d == "vllm" for d in dialects) else "narwhal"

    card = {"id": cfg.model, "object": "model", "created": created,
            "owned_by": owned_by(e.dialect for e in cfg.engines or cfg.sim.engines),
            "root": sizer.source.removeprefix("hf:") if sizer.source.startswith("hf:") else cfg.model}

    def fleet_context() -> int:
        """The longest context of the fleet's engines, as this replica's lease last saw them (0: not known)."""
        view = lease.view if lease is not None else None
        context = view.context() if view is not None else None
        return context.longest if context is not None and context.every else 0

    def card_now() -> dict[str, Any]:
        """The model card, with ``max_model_len`` as vLLM's has it once the engines have said theirs,
        and ``owned_by`` from the engines this replica's lease last saw (engines registered at run
        time included), else from the config."""
        context = fleet_context()
        view = lease.view if lease is not None else None
        now = {**card, "max_model_len": context} if context else dict(card)
        if view is not None and view.engines:
            now["owned_by"] = owned_by(e.cfg.dialect for e in view.engines)
        return now

    def key_refused(request: Request) -> Response | None:
        """The 401 for a missing or unknown API key where keys are required (None: let through):
        the model routes ask for a key as vLLM's /v1/* and OpenAI's do (clients check a key by
        listing the models)."""
        try:
            handler.tenancy.identify(request)
        except NarwhalError as err:
            return error_response(err.info(), None)
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return key_refused(request) or JSONResponse({"object": "list", "data": [card_now()]})

    @app.get("/v1/models/{model:path}")  # OpenAI's "retrieve model" (`client.models.retrieve`); a name may hold "/"
    async def model(model: str, request: Request) -> Response:
        if (refused := key_refused(request)) is not None:
            return refused
        if model != cfg.model:
            return error_response(model_not_found(model, cfg.model).info(), None)
        return JSONResponse(card_now())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    # vLLM's SageMaker health check answers as its /health does: liveness (a router whose fleet is out
    # for a while is still the one to keep; /ready says whether it admits)
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/ready")
    async def ready() -> Response:
        snap = await backend.snapshot()
        # then renew the lease: this replica admits on a view at least as new as what /ready says (the
        # other way round, a view granted just before the router turned ready refused the requests
        # that followed a 200 until the next grant)
        await reporter.flush()
        if snap["ready"]:
            return JSONResponse({"ready": True, "state": "active"})
        return JSONResponse({"ready": False, "reason": snap["state"]}, status_code=503)

    @app.get("/status")
    async def status() -> dict[str, Any]:
        await reporter.flush()
        snap = await backend.snapshot()
        # how this ingress sizes prompts: "hf:<dir>" (exact token IDs) or "estimate"; and, where its
        # relay runs here, which engines get prompts as its token IDs (tokenization/forward.py)
        local = backend.local_relay
        return {**snap, "tokenizer": sizer.source, "prompt_ids": None if local is None else local.forwarding.status()}

    @app.get("/metrics")
    async def metrics() -> Response:
        await reporter.flush()
        return PlainTextResponse(await backend.metrics_text(), media_type="text/plain; version=0.0.4")

    def admin_route(op_on: str, op_off: str, parse: Callable[[Any], Any]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            try:
                _check_admin(cfg, request)
                # strict JSON within the request limits, as every other body (deep nesting was a
                # 500); none at all is {} (a bare `POST /admin/drain` drains with the default grace)
                raw = await read_body(request, cfg.serving.max_request_bytes, cfg.serving.body_timeout_s)
                arg = parse(decode_json(raw) if raw.strip() else {})
                result = await backend.admin(op_on if request.method == "POST" else op_off, arg)
                await reporter.flush()  # this replica's lease sees the change before the answer
            except NarwhalError as err:
                return closing_after(err, error_response(err.info(), None))
            except BodyIncomplete:
                return error_response(InvalidRequest(BODY_INCOMPLETE, code="body_incomplete").info(), None)
            except ValueError as exc:
                return error_response(InvalidRequest(str(exc)).info(), None)
            return JSONResponse({"ok": True, "result": result})

        return route

    app.add_api_route(
        "/admin/maintenance",
        admin_route("maintenance_on", "maintenance_off", _waves),
        methods=["POST", "DELETE"],
    )
    app.add_api_route(
        "/admin/engines", admin_route("register", "deregister", _engine_arg), methods=["POST", "DELETE"]
    )
    app.add_api_route("/admin/state", admin_route("set_mode", "set_mode", _mode_arg), methods=["POST"])
    # draining (the run command sends it on SIGTERM): no new admissions, the streams still open
    # after grace_s ended with an error event (docs/operations.md)
    app.add_api_route("/admin/drain", admin_route("drain", "drain", lambda b: _drain_arg(b, cfg.serving.drain_grace_s)),
                      methods=["POST"])
    return app


def _waves(body: Any) -> list[str]:
    waves = body.get("waves") if isinstance(body, dict) else None
    if not isinstance(waves, list) or not all(isinstance(w, str) for w in waves):
        raise InvalidRequest("'waves' must be a list of strings", param="waves")
    return waves


def _engine_arg(body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("body must be an object")
    return body.get("name") if set(body) == {"name"} else body


def _drain_arg(body: Any, default_s: float) -> float:
    grace = body.get("grace_s", default_s) if isinstance(body, dict) else default_s
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < 86400:
        raise InvalidRequest("'grace_s' must be a number of seconds, 0 to 86400", param="grace_s")
    return float(grace)


def _mode_arg(body: Any) -> str:
    mode = body.get("mode") if isinstance(body, dict) else None
    if not isinstance(mode, str):
        raise InvalidRequest("'mode' must be a string", param="mode")
    return mode


def _check_admin(cfg: NarwhalConfig, request: Request) -> None:
    token = os.environ.get(cfg.admin.token_env, "")
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    # the scheme in any case (RFC 9110); bytes: compare_digest refuses non-ASCII str (a hostile
    # header must be a 401, not a 500), and the header's bytes are what the client sent
    if not token or scheme.lower() != "bearer" or not secrets.compare_digest(
            given.strip().encode("latin-1", "replace"), token.encode()):
        raise InvalidApiKey("admin routes need 'Authorization: Bearer <admin token>'")
