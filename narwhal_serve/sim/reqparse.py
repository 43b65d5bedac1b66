"""Request bodies (validated like vLLM's pydantic models) and vLLM's error envelope."""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from narwhal_serve.config.sim import FAULT_NAMES, SCRIPT_NAMES

M = TypeVar("M", bound=BaseModel)


class SimError(Exception):
    """An error answered in vLLM's envelope: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param)


def error_response(
    status: int, message: str, type_: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> SimError:
    return SimError(400, message, "BadRequestError", param)


def validation_error(exc: ValidationError) -> SimError:
    """vLLM 0.32's 400 for a body that fails validation (see ``error_bad_body.json``)."""
    items = []
    for e in exc.errors(include_url=False, include_context=False):
        loc = ".".join(["body", *(str(p) for p in e["loc"])])
        items.append({"type": e["type"], "loc": loc, "msg": e["msg"], "input": e.get("input")})
    n = len(items)
    message = f"{n} validation error{'s' if n != 1 else ''}:\n  " + "\n  ".join(repr(i) for i in items)
    return SimError(400, message, "Bad Request", items[0]["loc"] if items else None)


class SimExt(BaseModel):
    """The ``sim`` body extension: ``{"script": NAME, "fault": NAME | [NAME], "fault_after": K}``."""

    model_config = ConfigDict(extra="forbid")

    script: str | None = None
    fault: str | list[str] | None = None
    fault_after: int = Field(default=2, ge=0)

    def faults(self) -> list[str]:
        if self.fault is None:
            return []
        return [self.fault] if isinstance(self.fault, str) else list(self.fault)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None  # (no bound in vLLM's schema: SamplingParams checks the one a request runs with)
    min_tokens: int = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = Field(default=1, ge=1)
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    priority: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    sim: SimExt | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage on every chunk too: only with ``include_usage`` (vLLM 0.32 api_utils.py ``should_include_usage``)."""
        return self.include_usage() and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True  # (vLLM's: a boolean, lax — 0 and "false" are False, null is refused)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


def vllm_error(message: str, param: str | None = None, value: Any = None) -> SimError:
    """A ``VLLMValidationError``'s 400: its message carries the parameter and value it names."""
    extras = [f"{k}={v}" for k, v in (("parameter", param), ("value", value)) if v is not None]
    return bad_request(f"{message} ({', '.join(extras)})" if extras else message, param)


def check_before(body: Any, kind: str) -> None:
    """vLLM's request models' ``mode="before"`` checks, on the raw body (before the schema)."""
    if not isinstance(body, dict):
        return
    # (pydantic runs a model's before-validators last defined first: vLLM's chat model checks
    # logprobs before stream_options)
    top = body.get("top_logprobs")
    if kind == "chat" and isinstance(top, (int, float)) and not isinstance(top, bool) \
            and (top == -1 or top > 0) and not body.get("logprobs"):
        raise vllm_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if body.get("stream_options") and not body.get("stream"):
        raise vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")
    if kind == "chat":  # (vLLM's check_tool_usage, its first rules)
        if body.get("tools") == []:
            raise vllm_error("`tools` must not be an empty array. Either provide at least one tool or omit the "
                              "field entirely.", "tools")
        choice = body.get("tool_choice")
        if choice is not None and choice != "none":
            if body.get("tools") is None:
                raise vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
            if choice not in ("auto", "required") and not isinstance(choice, dict):
                raise vllm_error(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
                                  f"or \"required\" are supported.", "tool_choice")


def _int_like(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


def check_sampling(req: "ChatRequest | CompletionRequest", max_tokens: int) -> None:
    """vLLM 0.32's ``SamplingParams._verify_args``, in its order and words, for the fields the
    simulator takes (``max_tokens``: the one the request runs with, asked or defaulted); first, as
    ``SamplingParams.from_optional`` does, ``logit_bias``'s keys as token IDs."""
    bad_keys = [k for k in (req.logit_bias or {}) if not _int_like(k)]
    if bad_keys:
        raise vllm_error(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad_keys!r}",
                          "logit_bias", bad_keys)
    presence = req.presence_penalty or 0.0
    frequency = req.frequency_penalty or 0.0
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = req.top_k or 0
    min_p = req.min_p or 0.0
    if not -2.0 <= presence <= 2.0:
        raise vllm_error(f"presence_penalty must be in [-2, 2], got {presence}.")
    if not -2.0 <= frequency <= 2.0:
        raise vllm_error(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    if not math.isfinite(repetition):
        raise vllm_error(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise vllm_error(f"repetition_penalty must be greater than zero, got {repetition}.")
    if not math.isfinite(temperature):
        raise vllm_error(f"temperature must be a finite number, got {temperature}.", "temperature", temperature)
    if temperature < 0.0:
        raise vllm_error(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature > 2.0:
        raise vllm_error(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    if not 0.0 < top_p <= 1.0:
        raise vllm_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if top_k < -1:
        raise vllm_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise vllm_error(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:  # (a prompt that fills the context leaves none)
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if req.min_tokens > max_tokens:
        raise vllm_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}.")
    if any(not s for s in req.stop_list()):
        raise vllm_error("stop cannot contain an empty string.")


def parse_body(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_sim_ext(ext: SimExt | None) -> None:
    if ext is None:
        return
    if ext.script is not None and ext.script not in SCRIPT_NAMES:
        raise bad_request(f"unknown sim script {ext.script!r}; known: {sorted(SCRIPT_NAMES)}", "sim.script")
    unknown = sorted(set(ext.faults()) - FAULT_NAMES)
    if unknown:
        raise bad_request(f"unknown sim fault(s) {unknown}; known: {sorted(FAULT_NAMES)}", "sim.fault")
