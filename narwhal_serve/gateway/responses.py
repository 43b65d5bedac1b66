"""Rendering refusals: the OpenAI envelope, Retry-After, X-Narwhal-Reason, X-Request-Id."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from narwhal_serve.errors import ErrorInfo


def error_response(info: ErrorInfo, request_id: str | None) -> JSONResponse:
    headers = info.headers()
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(info.body(), status_code=info.status, headers=headers)
