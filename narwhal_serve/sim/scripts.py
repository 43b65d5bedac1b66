"""What a request outputs, as a list of steps (one token and one SSE content chunk each).

Plain requests output content steps from :func:`textgen.generate`.  Chat requests may pick a script
with ``"sim": {"script": NAME}``:

* ``reasoning`` / ``reasoning_content``: the first half of the tokens (at least one) are reasoning
  deltas under that key, the rest content;
* ``tool_calls``: two function calls (index 0 and 1), streamed the way vLLM does; finish ``tool_calls``;
* ``refusal``: ``refusal`` deltas;
* ``function_call``: legacy ``function_call`` deltas; finish ``function_call``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from narwhal_serve.sim.textgen import GenToken, Generation, fragment_tokens, split_chunks, stable_hash

StepKind = Literal["content", "reasoning", "reasoning_content", "refusal", "tool_call", "function_call"]

TOOL_CALLS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("get_weather", ('{"city": ', '"Paris"', ', "unit": ', '"celsius"', "}")),
    ("get_time", ('{"timezone": ', '"UTC"', "}")),
)
REFUSAL_TEXT = "I'm sorry, but I can't help with that."


@dataclass(frozen=True)
class Step:
    """One output token's delta: ``text`` is content/reasoning/refusal text or an arguments fragment.

    ``name`` is set on the first step of a (tool or legacy function) call, ``tool_id`` on the first
    step of a tool call (unless the ``tool_call_no_id`` fault removed it).
    """

    kind: StepKind
    text: str
    token: GenToken
    tool_index: int = 0
    tool_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Output:
    steps: tuple[Step, ...]
    finish_reason: str
    stop_reason: str | None

    @property
    def token_ids(self) -> list[int]:
        return [s.token.token_id for s in self.steps]


def plain_output(gen: Generation) -> Output:
    return Output(tuple(Step("content", t.text, t) for t in gen.tokens), gen.finish_reason, gen.stop_reason)


def _reasoning(gen: Generation, key: StepKind) -> Output:
    n_reason = max(1, len(gen.tokens) // 2)
    steps = [Step(key if i < n_reason else "content", t.text, t) for i, t in enumerate(gen.tokens)]
    return Output(tuple(steps), gen.finish_reason, gen.stop_reason)


def _tool_calls(rng_seed: int, num_top: int, with_ids: bool) -> Output:
    steps: list[Step] = []
    for index, (name, fragments) in enumerate(TOOL_CALLS):
        toks = fragment_tokens((name, *fragments), stable_hash(rng_seed, index), num_top)
        call_id = f"chatcmpl-tool-{stable_hash('tool', rng_seed, index):016x}" if with_ids else None
        steps.append(Step("tool_call", "", toks[0], index, call_id, name))
        steps.extend(Step("tool_call", frag, tok, index) for frag, tok in zip(fragments, toks[1:]))
    return Output(tuple(steps), "tool_calls", None)


def _function_call(rng_seed: int, num_top: int) -> Output:
    name, fragments = TOOL_CALLS[0]
    toks = fragment_tokens((name, *fragments), rng_seed, num_top)
    steps = [Step("function_call", "", toks[0], 0, None, name)]
    steps.extend(Step("function_call", frag, tok) for frag, tok in zip(fragments, toks[1:]))
    return Output(tuple(steps), "function_call", None)


def _refusal(rng_seed: int, num_top: int) -> Output:
    frags = split_chunks(REFUSAL_TEXT)
    toks = fragment_tokens(frags, rng_seed, num_top)
    return Output(tuple(Step("refusal", f, t) for f, t in zip(frags, toks)), "stop", None)


def build_output(script: str | None, gen: Generation, rng_seed: int, num_top: int, tool_ids: bool = True) -> Output:
    """The output of a request: ``gen`` as content, or the named script."""
    if script is None:
        return plain_output(gen)
    if script in ("reasoning", "reasoning_content"):
        return _reasoning(gen, "reasoning" if script == "reasoning" else "reasoning_content")
    if script == "tool_calls":
        return _tool_calls(rng_seed, num_top, tool_ids)
    if script == "function_call":
        return _function_call(rng_seed, num_top)
    if script == "refusal":
        return _refusal(rng_seed, num_top)
    raise ValueError(f"unknown script {script!r}")


def step_delta(step: Step) -> dict[str, Any]:
    """The ``delta`` of the stream chunk carrying ``step`` (vLLM 0.32 serialization)."""
    if step.kind == "tool_call":
        call: dict[str, Any] = {"index": step.tool_index}
        if step.name is not None:
            if step.tool_id is not None:
                call["id"] = step.tool_id
            call["type"] = "function"
            call["function"] = {"name": step.name, "arguments": ""}
        else:
            call["function"] = {"arguments": step.text}
        return {"tool_calls": [call]}
    if step.kind == "function_call":
        if step.name is not None:
            return {"function_call": {"name": step.name, "arguments": ""}}
        return {"function_call": {"arguments": step.text}}
    return {step.kind: step.text}


def assemble_message(output: Output) -> dict[str, Any]:
    """The non-stream ``message`` of a chat completion: the concatenation of every step."""
    text: dict[str, str] = {}
    calls: list[dict[str, Any]] = []
    fcall: dict[str, str] | None = None
    for s in output.steps:
        if s.kind == "tool_call":
            if s.name is not None:
                call: dict[str, Any] = {"type": "function", "function": {"name": s.name, "arguments": ""}}
                if s.tool_id is not None:
                    call = {"id": s.tool_id, **call}
                calls.append(call)
            else:
                calls[-1]["function"]["arguments"] += s.text
        elif s.kind == "function_call":
            if s.name is not None:
                fcall = {"name": s.name, "arguments": ""}
            elif fcall is not None:
                fcall["arguments"] += s.text
        else:
            text[s.kind] = text.get(s.kind, "") + s.text
    has_other = bool(calls) or fcall is not None or "refusal" in text
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": text.get("content", None if has_other else ""),
        "refusal": text.get("refusal"),
        "annotations": None,
        "audio": None,
        "function_call": fcall,
    }
    if calls:
        msg["tool_calls"] = calls
    if "reasoning_content" in text:
        msg["reasoning_content"] = text["reasoning_content"]
    else:
        msg["reasoning"] = text.get("reasoning")
    return msg

