"""Rendering refusals: the OpenAI envelope, Retry-After, X-Narwhal-Reason, X-Request-Id."""

from __future__ import annotations

from typing import TypeVar

from fastapi.responses import JSONResponse
from starlette.responses import Response

from narwhal_serve.errors import BodyTimeout, ErrorInfo, NarwhalError

R = TypeVar("R", bound=Response)

BODY_INCOMPLETE = "the request body ended before its Content-Length"


def error_response(info: ErrorInfo, request_id: str | None) -> JSONResponse:
    headers = info.headers()
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(info.body(), status_code=info.status, headers=headers)


def closing_after(err: NarwhalError, resp: R) -> R:
    """``resp``, with ``Connection: close`` when ``err`` is a body that did not arrive in time:
    the rest of that body may still come, and cannot be told from a next request."""
    if isinstance(err, BodyTimeout):
        resp.headers["Connection"] = "close"
    return resp
