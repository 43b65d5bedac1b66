"""One error tree for every refusal Narwhal sends (docs/contract.md, "Errors").

    NarwhalError                      status  type                        code
    │                                 500     internal_error              (internal_error: a fault of the
    │                                                                      router's own; after headers, as an
    │                                                                      error event: slow_reader)
    ├── InvalidRequest                400     invalid_request_error       invalid_request (body_incomplete;
    │                                                                      404 not_found, 405
    │                                                                      method_not_allowed)
    │   ├── InvalidSamplingWidth      400     invalid_request_error       invalid_sampling_width
    │   ├── UnsupportedOption         400     invalid_request_error       unsupported_option
    │   ├── ContextLengthExceeded     400     invalid_request_error       context_length_exceeded
    │   ├── ModelNotFound             404     invalid_request_error       model_not_found
    │   ├── RequestTooLarge           413     invalid_request_error       request_too_large
    │   └── BodyTimeout               408     invalid_request_error       request_timeout
    │                                                                      (HAProxy's rule, runenv.py:
    │                                                                      431 request_headers_too_large)
    ├── InvalidApiKey                 401     authentication_error        invalid_api_key
    ├── TokenizerUnavailable          404     invalid_request_error       tokenizer_unavailable
    │   (gateway/tokenize.py: /tokenize, /detokenize without a tokenizer)
    ├── RateLimited                   429     rate_limit_error            (retention_full, queue_full,
    │                                                                      ttft_budget_exceeded,
    │                                                                      prompt_exceeds_ttft_budget,
    │                                                                      tpot_budget_exceeded,
    │                                                                      tpot_budget_unattainable,
    │                                                                      rate_limit_exceeded)
    ├── TerminalExpiry                504     timeout_error               (admission_wait_expired,
    │                                                                      deadline_expired)
    ├── Unavailable                   503     service_unavailable_error   (backend_unavailable,
    │                                                                      router_unavailable,
    │                                                                      router_draining; after
    │                                                                      headers: router_draining)
    └── BadEngineResponse             502     upstream_error              bad_engine_response

Each error becomes an :class:`ErrorInfo` (plain data, what crosses the Ray hop), which renders the
OpenAI envelope (:meth:`ErrorInfo.body`) and the refusal headers (:meth:`ErrorInfo.headers`); callers
catch at any level.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ErrorInfo:
    """A serializable snapshot of an error: what crosses process boundaries."""

    status: int
    type: str
    code: str
    message: str
    param: str | None = None
    retry_after: int | None = None
    reason: str | None = None
    extra_headers: tuple[tuple[str, str], ...] = ()  # e.g. a tenant's x-ratelimit-* (tenants/)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {"X-Narwhal-Reason": self.reason or self.code}
        if self.retry_after is not None:
            out["Retry-After"] = str(self.retry_after)
        out.update(self.extra_headers)
        return out


# on a refusal no wait cures (the request itself must change): OpenAI's SDKs retry a 429 unless the
# answer says not to
NO_RETRY: tuple[tuple[str, str], ...] = (("x-should-retry", "false"),)


class NarwhalError(Exception):
    status = 500
    type = "internal_error"
    code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.reason = reason

    def info(self) -> ErrorInfo:
        return ErrorInfo(
            status=self.status,
            type=self.type,
            code=self.code,
            message=self.message,
            param=self.param,
            retry_after=self.retry_after,
            reason=self.reason,
        )


class InvalidRequest(NarwhalError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


def bad_request_id() -> InvalidRequest:
    """An ``X-Request-Id`` the router will not carry to its engines: the ingress's answer, and the
    one HAProxy's rule gives in direct-ingress mode (``narwhal_serve.runenv``), word for word."""
    return InvalidRequest("header X-Request-Id must be 1-128 printable ASCII characters, no spaces",
                          param="x-request-id")


class InvalidSamplingWidth(InvalidRequest):
    code = "invalid_sampling_width"

    def __init__(self, param: str, message: str | None = None) -> None:
        super().__init__(message or f"Invalid sampling width: {param} must be 1", param=param)

    @classmethod
    def prompts(cls, n: int) -> InvalidSamplingWidth:
        """A batch of prompts on ``/v1/completions``: each prompt is its own request here."""
        return cls("prompt", f"Invalid sampling width: a list of {n} prompts; send one prompt per request "
                             "(each is admitted against its own TTFT budget)")


class UnsupportedOption(InvalidRequest):
    code = "unsupported_option"


class ContextLengthExceeded(InvalidRequest):
    """A prompt (counted exactly) that leaves no engine of the fleet room for an output token
    (OpenAI's code for it; vLLM answers the same 400 in its own words)."""

    code = "context_length_exceeded"

    @classmethod
    def of(cls, kind: str, prompt_tokens: int, context: int) -> "ContextLengthExceeded":
        return cls(f"This model's maximum context length is {context} tokens. However, your prompt has "
                   f"{prompt_tokens} tokens, which leaves no room for output (at most {context - 1} prompt "
                   f"tokens). Please reduce the length of the prompt.",
                   param="messages" if kind == "chat" else "prompt")

    @classmethod
    def output(cls, param: str, max_tokens: int, context: int) -> "ContextLengthExceeded":
        """An output limit past the longest context: vLLM 0.32 refuses it whatever the prompt, in
        these words (a shorter one that the prompt leaves no room for is cut to the room left)."""
        return cls(f"{param}={max_tokens} cannot be greater than max_model_len={context}. Please request fewer "
                   f"output tokens.", param=param)

    @classmethod
    def truncation(cls, keep: int, context: int) -> "ContextLengthExceeded":
        """``truncate_prompt_tokens`` past the longest context: vLLM 0.32 refuses it whatever the
        prompt, after the output limit and before tokenizing (renderers/params.py), in these words."""
        return cls(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {context}. Please request "
                   f"a smaller truncation size.", param="truncate_prompt_tokens")


class ModelNotFound(InvalidRequest):
    status = 404
    code = "model_not_found"


class RequestTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"

    @classmethod
    def over(cls, limit: int) -> RequestTooLarge:
        """The router's answer, and HAProxy's for an ``Expect`` (:mod:`narwhal_serve.runenv`)."""
        return cls(f"The request body exceeds the limit of {limit} bytes.", param=None)


class BodyTimeout(InvalidRequest):
    """The body did not arrive within ``serving.body_timeout_s`` (a slow or stalled client)."""

    status = 408
    code = "request_timeout"

    @classmethod
    def after(cls, timeout_s: float) -> BodyTimeout:
        """The router's answer, and HAProxy's for an ``Expect`` (:mod:`narwhal_serve.runenv`)."""
        return cls(f"The request body did not arrive within {timeout_s:g} s.", param=None)


class InvalidApiKey(NarwhalError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def info(self) -> ErrorInfo:  # (RFC 9110: a 401 names the scheme it asks for)
        return replace(super().info(), extra_headers=(("WWW-Authenticate", "Bearer"),))


class RateLimited(NarwhalError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limited"


class TerminalExpiry(NarwhalError):
    status = 504
    type = "timeout_error"
    code = "deadline_expired"


class Unavailable(NarwhalError):
    status = 503
    type = "service_unavailable_error"
    code = "backend_unavailable"


def router_unavailable(reason: str) -> ErrorInfo:
    """The router refuses everything now (docs/contract.md, "Routes": the /ready reasons)."""
    return Unavailable(
        f"The router is not serving ({reason}); retry after the Retry-After delay.",
        code="router_unavailable",
        retry_after=1,
        reason=reason,
    ).info()


def backend_unavailable() -> ErrorInfo:
    """No engine can take work now."""
    return Unavailable(
        "No placement-eligible engine is available; retry after the Retry-After delay.",
        code="backend_unavailable",
        retry_after=1,
    ).info()


class BadEngineResponse(NarwhalError):
    status = 502
    type = "upstream_error"
    code = "bad_engine_response"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param)
