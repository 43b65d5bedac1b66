"""Generated requests for tokenization exactness: chat (system prompts, tools and tool calls, tool
results, multi-part content, developer messages, names) and completions, over English, code, CJK and
mixed scripts — each short enough for the tiny model's 512-token context."""

from __future__ import annotations

import json
import random
from typing import Any

_EN = "the quick brown fox jumps over the lazy dog while the router counts every token".split()
_CODE = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "SELECT id, name FROM t WHERE x > 3;",
         "```python\nprint('hi')\n```", "{\"key\": [1, 2, 3], \"ok\": true}", "\tindented\ttabs\r\nand CRLF"]
_CJK = ["你好，世界", "東京は日本の首都です", "한국어 문장입니다", "数据中心的路由器", "ラーメンを食べたい", "今日はいい天気ですね。"]
_OTHER = ["Привет, мир", "مرحبا بالعالم", "γειά σου κόσμε", "नमस्ते दुनिया", "emoji 🐋🦄 and ñandú", "  leading and trailing  "]


def _text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.3:
        return " ".join(rng.choice(_EN) for _ in range(rng.randint(1, 12)))
    if kind < 0.5:
        return rng.choice(_CODE)
    if kind < 0.75:
        return "".join(rng.choice(_CJK) for _ in range(rng.randint(1, 2)))
    if kind < 0.9:
        return rng.choice(_OTHER)
    return rng.choice(_EN) + " " + rng.choice(_CJK) + " " + rng.choice(_CODE)


def _content(rng: random.Random) -> Any:
    if rng.random() < 0.3:
        return [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 2))]
    return _text(rng)


_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}
_TOOL2 = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def chat_request(rng: random.Random, model: str) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    with_tools = rng.random() < 0.35
    if rng.random() < 0.5:
        msgs.append({"role": rng.choice(["system", "system", "developer"]), "content": _content(rng)})
    body: dict[str, Any] = {"model": model}
    for turn in range(rng.randint(1, 2 if with_tools else 3)):
        user: dict[str, Any] = {"role": "user", "content": _content(rng)}
        if rng.random() < 0.1:
            user["name"] = "alice"
        msgs.append(user)
        if turn and with_tools and rng.random() < 0.5:
            args = json.dumps({"city": rng.choice(["Paris", "東京", "Zürich"])}, ensure_ascii=rng.random() < 0.5)
            msgs.insert(-1, {"role": "assistant", "content": None,
                             "tool_calls": [{"id": f"call_{turn}", "type": "function",
                                             "function": {"name": "get_weather", "arguments": args}}]})
            msgs.insert(-1, {"role": "tool", "tool_call_id": f"call_{turn}", "content": _content(rng)})
        elif turn:
            msgs.insert(-1, {"role": "assistant", "content": _text(rng)})
    body["messages"] = msgs
    if with_tools:
        body["tools"] = [_TOOL] + ([_TOOL2] if rng.random() < 0.5 else [])
        body["tool_choice"] = "none"  # "auto" needs a tool parser on the engine; the template still gets the tools
    if rng.random() < 0.1:
        body["add_generation_prompt"] = False
    return body


def completion_request(rng: random.Random, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": _text(rng) + (" " + _text(rng) if rng.random() < 0.5 else "")}
    if rng.random() < 0.2:
        body["add_special_tokens"] = False
    return body


def exactness_requests(n: int, model: str, seed: int = 7) -> list[tuple[str, dict[str, Any]]]:
    """``n`` (route, body) pairs, two thirds chat."""
    rng = random.Random(seed)
    return [("chat", chat_request(rng, model)) if i % 3 else ("completion", completion_request(rng, model)) for i in range(n)]
