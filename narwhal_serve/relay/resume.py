"""Mid-stream resume (docs/contract.md, "Engine failures"): what an answer cut after its first token needs to
continue on another engine exactly where the dead one stopped.

The continuation is a completions request whose prompt is the request's prompt token IDs followed by
every identified output token ID, with ``max_tokens`` (and ``min_tokens``) reduced by what was
generated and the request's own sampling parameters.  Its chunks are re-shaped into the client's
route (chat deltas stay chat deltas) with the original ``id`` and ``created``; ``usage`` counts the
original prompt once and every output token once.

What cannot be exact is not resumed (:func:`not_resumable`, :func:`resume_refusal`): tool calls,
structured output, media (the prompt IDs hold only their placeholders), reasoning already split off
by the engine's parser (or a token it swallowed), what vLLM judges on generated tokens only — the
presence/frequency penalties, ``bad_words``, ``repetition_detection`` (the generated tokens become
prompt) —, stop strings (vLLM keeps up to ``len(stop) - 1`` characters that may begin one unsent,
and they die with it; with ``include_stop_str_in_output`` one may straddle the cut, and the tokens
after it would have to be trimmed as vLLM trims them), chat top logprobs (the completions endpoint
keys them by text: tokens that decode alike collapse), and a chat without a limit whose target's
context is unknown (vLLM's completions endpoint turns a ``max_tokens`` of null into 16).

A cut inside a character (the last tokens sent came without text: pieces of a multi-byte
character) is continued from before those tokens: vLLM's detokenizer, started on a prompt that ends
mid-character, would write the whole prompt's text again.  The continuation generates them anew;
they are not sent twice (checked to be the same tokens: a sampled answer that takes another turn
there cannot be exact, and ends with the error event), and a client that was sent their logprobs
is not resumed.  A chunk that carried several tokens (vLLM merges the steps its reader fell behind
on) may end inside a character with its text sent up to it: how many of its tokens are that
character's is read from the model's tokenizer where the router has one (:meth:`Transcript.settle`),
else such a cut is not resumed.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.legs import dialect_of
from narwhal_serve.engines.vllm import client_body
from narwhal_serve.errors import BadEngineResponse
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.requests import ParsedRequest, has_media, hides_reasoning

# The client's keys a continuation must not carry (the completions endpoint reads them differently,
# or the continuation sets them itself)
_DROPPED = frozenset({
    "messages", "prompt", "max_tokens", "max_completion_tokens", "min_tokens", "stream", "stream_options", "n",
    "echo", "logprobs", "top_logprobs", "prompt_logprobs", "suffix", "add_generation_prompt",
    "continue_final_message", "chat_template", "chat_template_kwargs", "documents", "add_special_tokens",
    "tool_choice", "parallel_tool_calls", "return_token_ids", "stream_interval", "kv_transfer_params",
    "priority", "logit_bias_as_ids", "echo_prompt",
    # the continuation's prompt is the one the engine ran, truncated already: truncating it with its
    # output again would drop the prompt's start (and the answer would be conditioned on another)
    "truncate_prompt_tokens", "truncation_side",
})
_STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs", "guided_decoding_backend")


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop if isinstance(s, str) and s] if isinstance(stop, list) else []


def not_resumable(req: ParsedRequest, holds_back_stops: bool) -> str | None:
    """Why ``req`` cannot be continued exactly on another engine (None: it can).  ``holds_back_stops``:
    the engine keeps text that may begin a stop string unsent (vLLM)."""
    b = req.body  # (n and best_of above 1, and beam search, are refused on arrival: protocol/requests.py)
    if b.get("tools") and b.get("tool_choice") != "none" or b.get("functions"):
        return "tool calls"
    for key in _STRUCTURED:
        v = b.get(key)
        if v is not None and not (key == "response_format" and isinstance(v, dict) and v.get("type") == "text"):
            return "structured output"
    if has_media(req.route, b):
        return "media"
    for key in ("presence_penalty", "frequency_penalty", "bad_words", "repetition_detection"):
        if b.get(key):
            return key.replace("_", " ")
    if holds_back_stops and stop_strings(b):
        return "stop strings"
    if req.route == "chat" and b.get("logprobs") and (b.get("top_logprobs") or b.get("logprob_token_ids")):
        return "chat top logprobs"
    return None


def unbounded(req: ParsedRequest) -> bool:
    """A chat without an output limit: it runs to the context (its continuation needs the target's)."""
    return req.route == "chat" and not isinstance(req.max_output_tokens, int)


def logprobs_wanted(req: ParsedRequest) -> int | None:
    """The number of top logprobs the client asked for (0: the sampled token's only), or None."""
    b = req.body
    if req.route == "chat":
        if not b.get("logprobs"):
            return None
        k = b.get("top_logprobs")
        return k if isinstance(k, int) and not isinstance(k, bool) else 0
    k = b.get("logprobs")
    return k if isinstance(k, int) and not isinstance(k, bool) else None


# A completion whose ``max_tokens`` is absent or null ends at 16 tokens on vLLM 0.32 (the OpenAI
# schema's default; its completions endpoint turns a null into it: normalize_null_max_tokens)
COMPLETION_DEFAULT_MAX_TOKENS = 16


def continuation_body(req: ParsedRequest, prompt_ids: list[int], output_ids: list[int],
                      context: int | None = None) -> dict[str, Any] | None:
    """The completions request that continues ``req`` after ``output_ids`` (None: nothing left to
    generate within the client's ``max_tokens``, or the context).  ``context``: the target engine's,
    which a chat without a limit runs to (:func:`unbounded`: never resumed without it)."""
    b = req.body
    body = {k: v for k, v in b.items() if k not in _DROPPED}
    done = len(output_ids)
    limit = req.max_output_tokens  # (a chat's max_completion_tokens unless null, else max_tokens: parse_request)
    if req.route == "completion" and b.get("max_tokens") is None:
        limit = COMPLETION_DEFAULT_MAX_TOKENS  # the engine's own limit for this request, which the continuation keeps
    if isinstance(limit, int):
        if limit - done < 1:
            return None
        body["max_tokens"] = limit - done
    else:  # a chat without one: up to the context, as before the cut (vLLM's chat limit is the room
        # its prompt leaves; vLLM 0.32 cuts a larger max_tokens to that room, but versions before it
        # whose renderer leaves the prompt context - max_tokens (vllm/renderers/params.py
        # TokenizeParams.max_input_tokens) refuse the whole context with any prompt)
        assert context is not None
        room = context - len(prompt_ids) - done
        if room < 1:
            return None  # the context is full: the engine would have ended here with "length"
        body["max_tokens"] = room
    least = b.get("min_tokens")
    if isinstance(least, int) and least > done:
        body["min_tokens"] = least - done
    k = logprobs_wanted(req)
    if k is not None:
        body["logprobs"] = k
    body["prompt"] = [*prompt_ids, *output_ids]
    body["stream"] = True
    so = b.get("stream_options")
    # Usage only where it is read: a streaming client that asked for it (on every chunk too, when
    # asked: the reshaper counts it as one answer's), and assembly.  A streaming client that did not
    # ask gets vLLM's plain stream, whose ``system_fingerprint`` rides the finish chunk (with usage
    # asked, vLLM puts it on the usage-only chunk, which the relay drops for this client).
    if req.include_usage or not req.stream:
        body["stream_options"] = ({"include_usage": True, "continuous_usage_stats": True}
                                  if isinstance(so, dict) and so.get("continuous_usage_stats") else {"include_usage": True})
    body["return_token_ids"] = True
    body["stream_interval"] = 1
    return client_body(body)


def chat_logprobs(lp: Any, k: int) -> dict[str, Any] | None:
    """A completions ``logprobs`` object as chat's ``{"content": [...]}``."""
    if not isinstance(lp, dict):
        return None
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    content = []
    for i, tok in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append({
            "token": tok, "logprob": values[i] if i < len(values) else None, "bytes": list(str(tok).encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(str(t).encode())}
                             for t, v in list(top.items())[:k]],
        })
    return {"content": content}


class DivergedResume(BadEngineResponse):
    """A continuation, sampling, generated another token where the cut character's first bytes were
    (the client has those): it cannot go on exactly, and no engine is at fault."""


class Transcript:
    """What the client has been sent of a single-choice answer: the prompt and output token IDs,
    the text (its tail, for stop strings across the cut), the metadata to continue under."""

    __slots__ = ("route", "prompt_ids", "output_ids", "text_len", "finish_reason", "reasoning", "meta", "silent",
                 "unsure")

    def __init__(self, req: ParsedRequest) -> None:
        self.route = req.route
        self.prompt_ids: list[int] | None = list(req.prompt_token_ids) if req.prompt_token_ids else None
        self.output_ids: list[int] = []
        self.text_len = 0  # characters of output text sent
        self.finish_reason: str | None = None
        self.reasoning = False  # the engine's reasoning parser split some output off (or swallowed a token)
        self.silent = 0  # the last tokens sent that came without text (a character's first bytes)
        # the last chunk with text carried several tokens: the last of them may be a character's
        # first bytes, which the engine holds back (its text comes with the next token), so
        # ``silent`` may count too few; :meth:`settle` knows, with the model's tokenizer
        self.unsure = False
        self.meta: dict[str, Any] = {}

    def observe(self, chunk: dict[str, Any]) -> None:
        """One validated chunk as the client gets it (client route's shape)."""
        for key in ("id", "object", "created", "system_fingerprint"):
            if key in chunk and key not in self.meta:
                self.meta[key] = chunk[key]
        ids = chunk.get("prompt_token_ids")
        for ch in chunk.get("choices") or ():
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue
            if ids is None:
                ids = ch.get("prompt_token_ids")
            out = ch.get("token_ids")
            if isinstance(out, list):
                self.output_ids.extend(out)
            text = ch.get("text") if self.route == "completion" else None
            delta = ch.get("delta")
            if isinstance(delta, dict):
                text = delta.get("content")
                if delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"):
                    self.reasoning = True
                if out and "content" not in delta:  # a token the engine's parser kept back (a reasoning model's <think>)
                    self.reasoning = True
            if out:
                if isinstance(text, str) and text:
                    self.silent, self.unsure = 0, len(out) > 1
                else:
                    self.silent += len(out)
            if isinstance(text, str) and text:
                self.text_len += len(text)
            if ch.get("finish_reason") is not None:
                self.finish_reason = ch["finish_reason"]
        if isinstance(ids, list):  # what the engine ran wins over the router's own tokenization
            self.prompt_ids = list(ids)

    def settle(self, decode: Callable[[list[int]], str]) -> None:
        """``silent`` from the tokens themselves, decoded by the model's tokenizer (exact whatever
        the chunks carried); left to the chunks' count where the tail is no cut character."""
        n = held_back(decode, self.output_ids, self.prompt_ids or ())
        if n is not None:
            self.silent, self.unsure = n, False


# A character is at most 4 bytes, so at most 4 tokens: a longer undecodable tail is not a cut character
HELD_BACK_MAX = 8


def held_back(decode: Callable[[list[int]], str], ids: Sequence[int], prompt: Sequence[int] = ()) -> int | None:
    """How many of ``ids``' last tokens end inside a character: their bytes decode to no complete
    one yet, so vLLM's detokenizer has sent none of their text (it holds back text that ends in
    U+FFFD).  None: more than a character's worth.  Each decode is of a few tokens before the
    point tried, enough to hold the whole character that ends there — the prompt's last tokens
    too, as vLLM's detokenizer starts from them (a prompt that ends inside a character has it
    completed by the output's first token, whose text is sent)."""
    ctx = [*prompt[-HELD_BACK_MAX:], *ids]
    start = len(ctx) - len(ids)  # where the output begins in ``ctx``
    for n in range(min(len(ids), HELD_BACK_MAX) + 1):
        k = len(ctx) - n
        if k == start or not decode(ctx[max(0, k - HELD_BACK_MAX):k]).endswith("\ufffd"):
            return n
    return None


class Reshaper:
    """Continuation chunks (completions shape) as the client's route expects them.  Returns the
    chunk, or None to drop it."""

    def __init__(self, req: ParsedRequest, t: Transcript, sent_prompt: list[int], redo: Sequence[int] = ()) -> None:
        self.route = req.route
        self.redo = list(redo)  # tokens sent before the cut, without text, that the continuation generates again
        self.t = t
        self.lp_k = logprobs_wanted(req)
        self.sent_prompt = sent_prompt
        self.prompt_tokens = len(t.prompt_ids or ())
        self.before = len(t.output_ids)  # output tokens before the cut
        self.new_tokens = 0
        # where the continuation's text starts in the whole answer: its engine's offsets count from
        # its own first character, across its chunks (vLLM's do), so this base never moves
        self.offset = t.text_len

    def prompt_checked(self, chunk: dict[str, Any]) -> None:
        """The continuation must have run on exactly the prompt sent (when its engine says)."""
        for ch in chunk.get("choices") or ():
            ids = ch.get("prompt_token_ids") if isinstance(ch, dict) else None
            if isinstance(ids, list) and ids != self.sent_prompt:
                raise BadEngineResponse("the continuation engine did not run on the prompt it was sent",
                                        param="choices.0.prompt_token_ids")

    def _redone(self, ids: list[int]) -> list[int]:
        """``ids`` less the tokens that were sent before the cut (generated again: the same ones)."""
        n = min(len(self.redo), len(ids))
        if ids[:n] != self.redo[:n]:
            raise DivergedResume("the continuation took another turn inside the character cut by the failure: "
                                 "the answer cannot go on exactly", param="choices.0.token_ids")
        del self.redo[:n]
        return ids[n:]

    def reshape(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        self.prompt_checked(chunk)
        meta = self.t.meta
        usage = chunk.get("usage")
        choices = []
        redone = False  # a choice dropped: tokens the client has (continuous usage rides on them)
        for ch in chunk.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            raw = ch.get("text")
            text = raw if isinstance(raw, str) else ""
            ids = ch.get("token_ids")
            finish, stop_reason = ch.get("finish_reason"), ch.get("stop_reason")
            if self.redo and isinstance(ids, list) and ids:
                ids = self._redone(ids)
                if not ids and not text and finish is None:
                    redone = True
                    continue
            if isinstance(ids, list):
                self.new_tokens += len(ids)
            lp = ch.get("logprobs")
            if self.route == "chat":
                out: dict[str, Any] = {"index": 0, "delta": {"content": text} if text or ids else {},
                                       "logprobs": chat_logprobs(lp, self.lp_k) if self.lp_k is not None else None,
                                       "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids}
            else:
                out = {**ch, "index": 0, "text": text, "finish_reason": finish, "stop_reason": stop_reason,
                       "prompt_token_ids": None, "token_ids": ids}
                if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):
                    out["logprobs"] = {**lp, "text_offset": [o + self.offset for o in lp["text_offset"]]}
            choices.append(out)
        if not choices and (usage is None or redone):
            return None
        shaped: dict[str, Any] = {
            "id": meta.get("id", chunk.get("id")),
            "object": meta.get("object", "chat.completion.chunk" if self.route == "chat" else "text_completion"),
            "created": meta.get("created", chunk.get("created")),
            "model": chunk.get("model"),
            "choices": choices,
        }
        # (the first engine's, else the continuation's own: vLLM may send it on its last chunk only)
        fingerprint = meta.get("system_fingerprint", chunk.get("system_fingerprint"))
        if fingerprint is not None:
            shaped["system_fingerprint"] = fingerprint
        if isinstance(usage, dict):
            done = self.before + self.new_tokens
            shaped["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                               "total_tokens": self.prompt_tokens + done}
        return shaped


def resume_refusal(req: ParsedRequest, t: Transcript, engine: EngineConfig, resumes: int, max_resumes: int,
                   now: float, deadline: float) -> str | None:
    """Why a cut on ``engine`` is not resumed (an outcome label: docs/contract.md, "Engine failures"), or None."""
    if resumes >= max_resumes:
        return "limit"
    if now >= deadline:
        return "deadline"
    dialect = dialect_of(engine)
    if (not dialect.supports_token_ids or hides_reasoning(req) or t.prompt_ids is None or t.reasoning
            or (t.silent and logprobs_wanted(req) is not None)  # (their logprobs were sent)
            or t.unsure  # (where the cut character starts is unknown: Transcript.settle was not run)
            or not_resumable(req, holds_back_stops=dialect.name == "vllm") is not None):
        return "not_exact"
    return None


def resume_target(live: Sequence[EngineConfig], candidates: Sequence[RouteChoice],
                  excluded: Collection[str]) -> EngineConfig | None:
    """Where to continue: the least loaded engine eligible now (``live``, least loaded first: an
    engine of the fleet that was no candidate at admission, or busy then, may be the best now), else
    a candidate route's decode engine; never one that failed this request."""
    for pool in (live, [r.decode for r in candidates]):
        for e in pool:
            if e.name not in excluded and dialect_of(e).supports_token_ids:
                return e
    return None


def length_end(req: ParsedRequest, t: Transcript) -> dict[str, Any]:
    """The final chunk of an answer that reached its ``max_tokens`` when the engine died."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "stop_reason": None}
    if req.route == "chat":
        choice.update(delta={}, logprobs=None)
    else:
        choice.update(text="", logprobs=None)
    return {**t.meta, "model": None, "choices": [choice]}
