"""Validation and sizing of client requests (the contract's validation rows, docs/contract.md, "Errors").

Only the fields the router interprets are checked; every other field is forwarded to the engine
verbatim.  Errors carry ``param`` as a dotted path (``messages.0.content``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from narwhal_serve.errors import (
    InvalidRequest,
    InvalidSamplingWidth,
    ModelNotFound,
    UnsupportedOption,
)
from narwhal_serve.protocol.estimate import estimate_tokens
from narwhal_serve.protocol.options import (
    bad,
    check_nonstream_options,
    check_relayed_options,
    check_rendering,
    is_int,
    is_number,
    lax_bools,
    opt,
)
from narwhal_serve.protocol.strictjson import decode_json

Route = Literal["chat", "completion"]

# Content parts that are text, as vLLM reads them (its chat utils): ``text``, ``input_text`` and
# ``output_text`` in ``text``; a ``refusal`` part (OpenAI's, in an assistant message) in ``refusal``;
# a ``thinking`` part in ``thinking`` (part_text)
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})


def part_text_key(part: dict[str, Any]) -> str:
    """The key of a text part (TEXT_PART_TYPES) that holds its text."""
    ptype = part.get("type")
    if ptype == "refusal" and "refusal" in part:
        return "refusal"
    return "thinking" if ptype == "thinking" else "text"


_MEDIA_PART_TYPES = frozenset({"image_url", "input_image", "input_audio", "video_url", "file", "audio_url",
                               "image_embeds", "audio_embeds", "video_embeds"})  # (the embeds: vLLM's --enable-mm-embeds)
# A part without a ``type`` that holds one of these keys is that media part (vLLM 0.32 infers it:
# renderers/chat_utils.py, "missing 'type' but provided direct URL fields")
_UNTYPED_MEDIA_KEYS = ("image_url", "image_embeds", "audio_embeds", "video_embeds", "audio_url", "input_audio", "video_url")


def _is_media_part(part: dict[str, Any]) -> bool:
    """A media part: of a media type, or without a type and holding a media key."""
    ptype = part.get("type")
    return ptype in _MEDIA_PART_TYPES or (ptype is None and any(k in part for k in _UNTYPED_MEDIA_KEYS))


@dataclass(frozen=True)
class ParsedRequest:
    """A validated, sized request: what crosses the Ray hop instead of a Starlette request."""

    route: Route
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_tokens: int
    max_output_tokens: int | None
    prompt_token_ids: tuple[int, ...] | None = None
    min_output_tokens: int = 0  # tokens the engine writes at least (ignore_eos: max_tokens; else min_tokens)
    max_output_param: str = "max_tokens"  # the field max_output_tokens came from (chat: or max_completion_tokens)
    # the router's own token IDs of a text prompt (its tokenizer, exact): what it may send the
    # engine instead of the text (tokenization/forward.py); None for a token-ID or estimated prompt
    own_ids: tuple[int, ...] | None = None


def hides_reasoning(req: "ParsedRequest") -> bool:
    """A chat that asks the engine to hide its reasoning (``include_reasoning: false``): vLLM 0.32
    then leaves the output's token IDs (and logprobs) out of every chunk when it runs a reasoning
    or tool parser (chat_completion/serving.py ``hide_stream_metadata``), so the router counts its
    tokens as it does an engine's without IDs (content events, the engine's usage)."""
    return req.route == "chat" and req.body.get("include_reasoning") is False


def forces_tool(req: "ParsedRequest") -> bool:
    """A chat whose ``tool_choice`` forces a tool call: ``"required"`` or a named function."""
    choice = req.body.get("tool_choice")
    return req.route == "chat" and (choice == "required" or isinstance(choice, dict))


def truncated_to(body: dict[str, Any]) -> int | None:
    """How many of the prompt's tokens the engine keeps at most (``truncate_prompt_tokens`` N ≥ 1),
    or None: not cut, or cut to a length not known here (-1: the engine's context less one), or a
    value the engine refuses."""
    cut = body.get("truncate_prompt_tokens")
    return cut if is_int(cut) and cut >= 1 else None


ECHO_CHARS = 100  # what of a client's value an error message repeats


def model_not_found(asked: str, served: str) -> ModelNotFound:
    shown = asked if len(asked) <= ECHO_CHARS else asked[:ECHO_CHARS] + f"… ({len(asked)} characters)"
    return ModelNotFound(f"The model `{shown}` does not exist. This router serves `{served}`.", param="model")


# Integer fields: a whole-number float (``2.0``) is taken, as vLLM's schema takes it (pydantic's lax
# mode), and sent on as the integer; ``2.5`` (and a float past 64 bits) is still refused.
_INT_FIELDS = ("max_tokens", "min_tokens", "seed", "n", "best_of", "max_completion_tokens", "top_logprobs",
               "truncate_prompt_tokens")


def _whole(v: Any) -> bool:
    return isinstance(v, float) and v.is_integer() and abs(v) < 2**63  # (beyond: refused as a float, as vLLM refuses it)


def whole_ids(ids: list[Any]) -> list[Any]:
    """A token-ID list with its whole-number floats as integers (vLLM takes ``[1.0, 2.0]``)."""
    return [int(t) if _whole(t) else t for t in ids]


def _whole_numbers(body: dict[str, Any], route: Route) -> None:
    for key in _INT_FIELDS + (("logprobs",) if route == "completion" else ()):
        if _whole(body.get(key)):
            body[key] = int(body[key])
    p = body.get("prompt") if route == "completion" else None
    if isinstance(p, list) and p:
        if isinstance(p[0], list) and len(p) == 1:
            if any(_whole(t) for t in p[0]):
                body["prompt"] = [whole_ids(p[0])]
        elif any(_whole(t) for t in p):
            body["prompt"] = whole_ids(p)


def least_output(body: dict[str, Any], max_out: Any) -> int:
    """Output tokens an answer has at least: all of ``max_tokens`` with ``ignore_eos`` (vLLM's
    benchmark sends it, as every fixed-length load test does), else ``min_tokens`` (never above
    ``max_tokens``).  Stop strings may still end it earlier; admission expects it, it does not
    count on it."""
    cap = max_out if is_int(max_out) else None
    if body.get("ignore_eos") is True and cap is not None:
        return cap
    raw = body.get("min_tokens")
    least = raw if is_int(raw) else 0
    if least <= 0:
        return 0
    return least if cap is None else min(least, cap)


def check_model(body: dict[str, Any], model: str) -> None:
    """The model asked for: the configured one, or none (absent, null or empty: the configured one,
    as vLLM 0.32 serves its default; filled in, so every engine is asked for it by name); another
    is a 404."""
    m = body.get("model")
    if m is None or m == "":
        body["model"] = model
    elif not isinstance(m, str):
        raise bad("model", "must be a string")
    elif m != model:
        raise model_not_found(m, model)


def _check_common(body: dict[str, Any], model: str, route: Route) -> None:
    check_model(body, model)
    opt(body, "stream", lambda v: isinstance(v, bool), "must be a boolean")
    opt(body, "return_token_ids", lambda v: isinstance(v, bool), "must be a boolean")
    if route == "chat" and body.get("max_completion_tokens") is not None:  # (vLLM takes that one: this one unread)
        opt(body, "max_tokens", is_int, "must be an integer")
    else:
        opt(body, "max_tokens", lambda v: is_int(v) and v >= 1, "must be an integer >= 1")
    opt(body, "min_tokens", lambda v: is_int(v) and v >= 0, "must be an integer >= 0")
    opt(body, "temperature", is_number, "must be a number")
    opt(body, "top_p", is_number, "must be a number")
    opt(body, "seed", lambda v: is_int(v) and -2**63 <= v < 2**63, "must be a 64-bit integer")
    opt(body, "ignore_eos", lambda v: isinstance(v, bool), "must be a boolean")
    # (vLLM 0.32's bounds: -1 keeps its context less one, 0 nothing, N the last N; a side as named)
    opt(body, "truncate_prompt_tokens", lambda v: is_int(v) and -1 <= v < 2**63, "must be an integer >= -1")
    opt(body, "truncation_side", lambda v: v in ("left", "right"), "must be 'left' or 'right'")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise bad("stop", "must be a string or a list of strings")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options", "must be an object")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise bad("stream_options.include_usage", "must be a boolean")
        if so and not body.get("stream"):  # (as OpenAI and vLLM refuse it)
            raise bad("stream_options", "is only allowed when 'stream' is true")
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is None:  # (null is OpenAI's default, 1: not sent on, where an engine's schema wants a number)
            body.pop(key, None)
            continue
        if not is_int(v) or v < 1:
            raise bad(key, "must be an integer >= 1")
        if v > 1:
            raise InvalidSamplingWidth(key)


def _text_len_of_content(content: Any, path: str) -> int:
    if content is None or isinstance(content, str):
        return len(content or "")
    if not isinstance(content, list):
        raise bad(path, "must be a string, a list of content parts, or null")
    n = 0
    for i, part in enumerate(content):
        ppath = f"{path}.{i}"
        if isinstance(part, str):  # (a plain string in the list is text, as vLLM renders it; LangChain sends them)
            n += len(part)
            continue
        if isinstance(part, dict) and part.get("type") is None and _is_media_part(part):
            n += 256  # a media part told by its key (as below)
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad(ppath, "must be a content part object with a string 'type'")
        ptype = part["type"]
        if ptype == "tool_reference":  # a deferred tool's reference: vLLM renders its name
            name = part.get("name")
            n += len(name) if isinstance(name, str) else 0
        elif ptype in TEXT_PART_TYPES:
            key = part_text_key(part)
            text = part.get(key)
            if not isinstance(text, str):
                raise bad(f"{ppath}.{key}", "must be a string")
            n += len(text)
        elif ptype in _MEDIA_PART_TYPES:
            n += 256  # a fixed size estimate for a media part
        else:
            raise UnsupportedOption(f"content part type '{ptype}' is not supported", param=f"{ppath}.type")
    return n


def has_media(route: str, body: dict[str, Any]) -> bool:
    """A chat whose messages hold a media part (its prompt IDs carry only the media's placeholders)."""
    if route != "chat" or not isinstance(body.get("messages"), list):
        return False
    for msg in body["messages"]:
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and _is_media_part(part):
                return True
    return False


def check_messages(body: dict[str, Any]) -> int:
    """Chat ``messages`` as the router reads them (also ``/tokenize``'s); their characters."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "is required and must be a non-empty list")
    chars = 0
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise bad(f"messages.{i}", "must be an object")
        if not isinstance(msg.get("role"), str):
            raise bad(f"messages.{i}.role", "is required and must be a string")
        chars += _text_len_of_content(msg.get("content"), f"messages.{i}.content") + 4
    return chars


def _check_prompt(body: dict[str, Any]) -> tuple[int, tuple[int, ...] | None]:
    """Returns (prompt chars, prompt token ids when the client sent ids)."""
    p = body.get("prompt")
    if body.get("prompt_embeds") is not None:  # (vLLM's --enable-prompt-embeds: a tensor the router cannot size)
        raise UnsupportedOption("prompt_embeds is not supported: the router sizes every prompt (its admission "
                                "projects the prefill from the prompt's tokens)", param="prompt_embeds")
    if p == "":  # (vLLM 0.32's words; a list holding "" is served, as vLLM serves it)
        raise InvalidRequest("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    if isinstance(p, str):
        return len(p), None
    if isinstance(p, list) and p:
        if all(isinstance(s, str) for s in p):
            if len(p) > 1:
                raise InvalidSamplingWidth.prompts(len(p))
            return len(p[0]), None
        if all(is_int(t) for t in p):
            return 0, _token_ids(p, "prompt")
        if all(isinstance(s, list) for s in p):
            if len(p) > 1:
                raise InvalidSamplingWidth.prompts(len(p))
            if p[0] and all(is_int(t) for t in p[0]):  # [[]] is as empty as []
                return 0, _token_ids(p[0], "prompt.0")
    raise bad("prompt", "is required and must be a string or a list of token ids")


def _token_ids(ids: list[int], path: str) -> tuple[int, ...]:
    """A prompt's token IDs, each at least 0 (a negative one is named by its place, as vLLM names it)."""
    for i, t in enumerate(ids):
        if t < 0:
            raise bad(f"{path}.{i}", "must be a token id: an integer >= 0")
    return tuple(ids)


MAX_LOGPROBS = 20  # vLLM's --max-logprobs default (and OpenAI's top_logprobs bound)


def parse_request(route: Route, raw: bytes, *, model: str, max_logprobs: int = MAX_LOGPROBS) -> ParsedRequest:
    """Validate ``raw`` for ``route``; raises an :class:`InvalidRequest` subclass.  ``max_logprobs``:
    the engines' ``--max-logprobs`` (``serving.max_logprobs``): more is refused here, in the
    router's words, instead of relaying the engine's validation dump."""
    cap = f"an integer from 0 to {max_logprobs}"
    body = decode_json(raw)
    _whole_numbers(body, route)
    _check_common(body, model, route)
    stream = bool(body.get("stream", False))
    ids: tuple[int, ...] | None = None
    if route == "chat":
        chars = check_messages(body)
        check_rendering(body)
        opt(body, "logprobs", lambda v: isinstance(v, bool), "must be a boolean")
        opt(body, "top_logprobs", lambda v: is_int(v) and 0 <= v <= max_logprobs, f"must be {cap}")
        opt(body, "max_completion_tokens", lambda v: is_int(v) and v >= 1, "must be an integer >= 1")
        # (vLLM: max_completion_tokens unless null, then max_tokens; a refusal names the one taken)
        max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_out = body.get(max_param)
    else:
        chars, ids = _check_prompt(body)
        opt(body, "logprobs", lambda v: is_int(v) and 0 <= v <= max_logprobs, f"must be {cap}")
        max_param, max_out = "max_tokens", body.get("max_tokens")
    check_relayed_options(body)
    if not stream:
        check_nonstream_options(body)
    so = body.get("stream_options") or {}
    prompt_tokens = len(ids) if ids is not None else estimate_tokens(chars)  # exact where the router tokenizes (tokenization/sizer.py)
    if (cut := truncated_to(body)) is not None:
        prompt_tokens = min(prompt_tokens, cut)
    return ParsedRequest(
        route=route,
        body=body,
        stream=stream,
        include_usage=bool(so.get("include_usage", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        prompt_tokens=prompt_tokens,
        max_output_tokens=max_out if isinstance(max_out, int) else None,
        max_output_param=max_param,
        prompt_token_ids=ids,
        min_output_tokens=least_output(body, max_out),
    )
