"""The FastAPI app of one simulated engine: :func:`create_app`."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.engine import Engine
from narwhal_serve.sim.handlers import handle_generate, read_json, wait_disconnect
from narwhal_serve.sim.metrics import render_metrics
from narwhal_serve.sim.reqparse import SimError, TokenizeRequest, bad_request, parse_body, validation_error
from narwhal_serve.sim.textgen import encode_prompt, render_chat, stable_hash, token_str

_CONTROL_ACTIONS = ("clear_prefix_cache", "reset_stats")


def get_engine(app: FastAPI) -> Engine:
    engine = app.state.sim_engine
    assert isinstance(engine, Engine)
    return engine


def _models(cfg: SimEngineConfig) -> dict[str, Any]:
    now = int(time.time())
    perm = {
        "id": f"modelperm-{stable_hash('perm', cfg.model) & 0xFFFFFFFFFFFFFFFF:016x}",
        "object": "model_permission", "created": now, "allow_create_engine": False, "allow_sampling": True,
        "allow_logprobs": True, "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
        "organization": "*", "group": None, "is_blocking": False,
    }
    card = {"id": cfg.model, "object": "model", "created": now, "owned_by": "vllm", "root": cfg.model,
            "parent": None, "max_model_len": cfg.max_model_len, "permission": [perm]}
    return {"object": "list", "data": [card]}


def _control(engine: Engine, body: Any) -> dict[str, Any]:
    """Apply a ``/sim/control`` body: any config fields (faults, timing, ...) and one-off actions."""
    if not isinstance(body, dict):
        raise bad_request("control body must be a JSON object", "body")
    updates = {k: v for k, v in body.items() if k not in _CONTROL_ACTIONS}
    try:
        cfg = SimEngineConfig.model_validate({**engine.cfg.model_dump(), **updates})
    except ValidationError as exc:
        raise validation_error(exc) from None
    engine.reconfigure(cfg)
    if body.get("clear_prefix_cache"):
        engine.clear_prefix_cache()
    if body.get("reset_stats"):
        engine.recent.clear()
        engine.total_requests = 0
    return cfg.model_dump()


def create_app(cfg: SimEngineConfig) -> FastAPI:
    """A fresh app (and engine state) serving ``cfg``; ``app.state.sim_engine`` is the :class:`Engine`."""
    app = FastAPI(title=f"narwhal-sim {cfg.name}", docs_url=None, redoc_url=None, openapi_url=None)
    engine = Engine(cfg.model_copy(deep=True))
    app.state.sim_engine = engine

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle_generate(engine, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_generate(engine, request, "completion")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(_models(engine.cfg))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if "unhealthy" in engine.cfg.faults else 200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if "stale_metrics" in engine.cfg.faults:
            await wait_disconnect(request, engine)
            return Response(status_code=503)
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            req = parse_body(TokenizeRequest, await read_json(request))
            if req.model is not None and req.model != engine.cfg.model:
                raise SimError(404, f"The model `{req.model}` does not exist. Valid aliases: {engine.cfg.model}.",
                               "NotFoundError", "model")
            if req.messages is not None:
                ids = render_chat([(m.role, m.text()) for m in req.messages], req.add_generation_prompt)
            elif req.prompt is not None:
                ids = encode_prompt(req.prompt, req.add_special_tokens)
            else:
                raise bad_request("either prompt or messages is required", "prompt")
        except SimError as exc:
            return exc.response()
        strs = [token_str(i) for i in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.cfg.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/sim/control")
    async def control(request: Request) -> Response:
        try:
            return JSONResponse(_control(engine, await read_json(request)))
        except SimError as exc:
            return exc.response()

    @app.get("/sim/control")
    async def get_control() -> JSONResponse:
        return JSONResponse(engine.cfg.model_dump())

    @app.get("/sim/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(engine.stats())

    return app
