"""Chat choice assembly: deltas → one ``message``.

* ``content``, ``reasoning``, ``reasoning_content`` and ``refusal`` string deltas concatenate.  Each
  assembles to null when no delta carried it (vLLM's role-announcing first delta, ``content: ""``,
  does not count), else to the concatenation (possibly ``""``: a token that decoded to nothing).
  ``reasoning`` is always present (vLLM 0.32 shape, null when absent); ``reasoning_content`` (older
  vLLM) appears only when the engine streamed it, so the client gets what the engine sent.
* ``tool_calls`` fragments group by their stream ``index``; ``id``, ``function.name`` and
  ``function.arguments`` concatenate independently; calls come back in index order as
  ``{"id", "type": "function", "function": {"name", "arguments"}}``.  Every call needs an id and a
  function name (checked in :meth:`ChatChoiceFold.result`).  ``tool_calls`` is present only when
  some call was streamed (vLLM omits an empty list).  ``type`` other than ``"function"`` (custom
  tools) is a 502, as is any other valued key (e.g. ``custom``).
* legacy ``function_call`` name/argument fragments concatenate into ``message.function_call``; a
  function call without a name is malformed (502).
* any other delta key carrying a value (``audio``, ``annotations``, ...) is a 502; null passes.
"""

from __future__ import annotations

from typing import Any

from ._common import bad, carries_value, index_of, join, opt_dict, opt_list, opt_str, reject_unknown
from .choice_base import KEPT_FIELDS, ChoiceFold
from .logprobs import ChatLogprobs
from .tokens import CHAT_GENERATED

TEXT_KEYS = ("content", "reasoning", "reasoning_content", "refusal")
DELTA_KEYS = frozenset({"role", *TEXT_KEYS, "tool_calls", "function_call"})
TOOL_CALL_KEYS = frozenset({"index", "id", "type", "function"})
FUNCTION_KEYS = frozenset({"name", "arguments"})


class _Call:
    __slots__ = ("id", "name", "arguments")

    def __init__(self) -> None:
        self.id: list[str] = []
        self.name: list[str] = []
        self.arguments: list[str] = []


class ChatChoiceFold(ChoiceFold):
    KNOWN = frozenset({"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids",
                       "prompt_token_ids", "prompt_logprobs"}) | KEPT_FIELDS

    def __init__(self, index: int, *, no_content: str | None = None) -> None:
        super().__init__(index)
        self.no_content = no_content  # ``content`` when no delta carried any (Assembler's ``forced_tool_content``)
        self.role: str | None = None
        self.texts: dict[str, list[str]] = {}
        self.calls: dict[int, _Call] = {}
        self.function_call: _Call | None = None
        self.logprobs = ChatLogprobs()

    def feed_output(self, choice: dict[str, Any], path: str) -> bool:
        delta = opt_dict(choice, "delta", path)
        event = False
        if delta is not None:
            event = self._delta(delta, join(path, "delta"))
        lp = choice.get("logprobs")
        if lp is not None:
            self.logprobs.feed(lp, join(path, "logprobs"))
        return event

    def _delta(self, delta: dict[str, Any], path: str) -> bool:
        reject_unknown(delta, DELTA_KEYS, path)
        role = opt_str(delta, "role", path)
        if role is not None:
            self.role = role
        any_text = False
        for key in TEXT_KEYS:
            value = opt_str(delta, key, path)
            if value is None:
                continue
            any_text = True
            if role is not None and value == "":
                continue  # the role announcement's empty content is not output
            self.texts.setdefault(key, []).append(value)
        calls = opt_list(delta, "tool_calls", path)
        if calls:
            self._tool_calls(calls, join(path, "tool_calls"))
        fn = opt_dict(delta, "function_call", path)
        if fn is not None:
            self._function_call(fn, join(path, "function_call"))
        if role is not None:
            return any(carries_value(delta.get(key)) for key in CHAT_GENERATED)
        return any_text or bool(calls) or carries_value(fn)

    def _tool_calls(self, calls: list[Any], path: str) -> None:
        for pos, frag in enumerate(calls):
            fpath = join(path, pos)
            if not isinstance(frag, dict):
                bad(f"Engine field {fpath} must be an object", fpath)
            reject_unknown(frag, TOOL_CALL_KEYS, fpath)
            index = index_of(frag, fpath)
            kind = opt_str(frag, "type", fpath)
            if kind is not None and kind != "function":
                bad(f"Engine sent unsupported tool call type {kind!r}", join(fpath, "type"))
            call = self.calls.get(index)
            if call is None:
                call = self.calls[index] = _Call()
            call_id = opt_str(frag, "id", fpath)
            if call_id:
                call.id.append(call_id)
            fn = opt_dict(frag, "function", fpath)
            if fn is not None:
                self._fold_function(fn, join(fpath, "function"), call)

    def _function_call(self, fn: dict[str, Any], path: str) -> None:
        if self.function_call is None:
            self.function_call = _Call()
        self._fold_function(fn, path, self.function_call)

    @staticmethod
    def _fold_function(fn: dict[str, Any], path: str, call: _Call) -> None:
        reject_unknown(fn, FUNCTION_KEYS, path)
        name = opt_str(fn, "name", path)
        if name:
            call.name.append(name)
        arguments = opt_str(fn, "arguments", path)
        if arguments:
            call.arguments.append(arguments)

    def _text(self, key: str) -> str | None:
        parts = self.texts.get(key)
        return None if parts is None else "".join(parts)

    def _tool_calls_out(self, path: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for pos, index in enumerate(sorted(self.calls)):
            call = self.calls[index]
            cpath = join(path, pos)
            call_id = "".join(call.id)
            name = "".join(call.name)
            if not call_id:
                bad(f"Engine tool call {index} has no id", join(cpath, "id"))
            if not name:
                bad(f"Engine tool call {index} has no function name", join(cpath, "function.name"))
            out.append({"id": call_id, "type": "function",
                        "function": {"name": name, "arguments": "".join(call.arguments)}})
        return out

    def result(self, path: str, *, return_token_ids: bool) -> dict[str, Any]:
        mpath = join(path, "message")
        function_call: dict[str, Any] | None = None
        if self.function_call is not None:
            name = "".join(self.function_call.name)
            if not name:
                bad("Engine function call has no name", join(mpath, "function_call.name"))
            function_call = {"name": name, "arguments": "".join(self.function_call.arguments)}
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": self._text("content") if "content" in self.texts else self.no_content,
            "refusal": self._text("refusal"),
            "annotations": None,
            "audio": None,
            "function_call": function_call,
        }
        tool_calls = self._tool_calls_out(join(mpath, "tool_calls"))
        if tool_calls:
            message["tool_calls"] = tool_calls
        message["reasoning"] = self._text("reasoning")
        if "reasoning_content" in self.texts:
            message["reasoning_content"] = self._text("reasoning_content")
        out: dict[str, Any] = {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs.result(),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            **self.kept,
        }
        out["token_ids"] = self.token_ids_out() if return_token_ids else None
        out["routed_experts"] = None
        return out
