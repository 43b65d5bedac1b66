"""Per request: the prompt's exact token IDs from the model's tokenizer, or the estimate.

Where the tokenizer comes from (:func:`tokenizer_path`): ``tokenizer:`` in the config (a local
Hugging Face tokenizer directory), else the model directory of a managed vLLM/SGLang engine when it
is a local directory holding ``tokenizer.json``.  Without one the router sizes text prompts with the
estimate (``/status`` says which for the ingress, the request log's ``prompt_sizing`` per request).

Tokenizing a long prompt takes milliseconds (about 0.7 µs per byte here), so prompts past
:data:`INLINE_CHARS` are tokenized on a small thread pool: the Rust tokenizer releases the GIL, and
the event loop keeps serving other requests meanwhile.  Requests and ``/tokenize`` take the same path
(:meth:`PromptSizer.encode`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from narwhal_serve.errors import InvalidRequest
from narwhal_serve.protocol import truncated_to
from narwhal_serve.protocol.estimate import CHARS_PER_TOKEN
from narwhal_serve.tokenization.chat import NotExact

if TYPE_CHECKING:
    from collections.abc import Sequence

    from narwhal_serve.config import NarwhalConfig
    from narwhal_serve.protocol.requests import ParsedRequest
    from narwhal_serve.tokenization.hf import Encoded

log = logging.getLogger("narwhal.tokenization")

SIM = "narwhal-sim"
INLINE_CHARS = 4096  # shorter prompts are tokenized on the event loop (a thread hop costs more)
ESTIMATE = "estimate"


def tokenizer_path(cfg: "NarwhalConfig") -> str | None:
    """The tokenizer for the config's model: a directory, ``narwhal-sim`` (the simulator's), or None
    (the estimate).  The embedded simulated fleet and managed ``sim`` engines get the simulator's."""
    if cfg.tokenizer == ESTIMATE:
        return None
    if cfg.tokenizer:
        return cfg.tokenizer
    if not cfg.engines:
        return SIM
    if all(e.launch is not None and e.launch.kind == "sim" for e in cfg.engines):
        return SIM
    for e in cfg.engines:
        spec = e.launch
        if spec is not None and spec.kind in ("vllm", "sglang") and spec.model and os.path.isdir(spec.model):
            if (Path(spec.model) / "tokenizer.json").is_file():
                flag = renders_otherwise(spec.args)
                changed = f"started with {flag}" if flag else renders_itself(Path(spec.model))
                if changed is None:
                    return spec.model
                log.warning("engine %s: %s: its prompts are not rendered as its model directory's "
                            "tokenizer renders them; sizing with the estimate (set `tokenizer:` to override)",
                            e.name, changed)
                return None
    return None


# Engine flags under which a model directory's tokenizer and chat template are not what the engine
# renders and counts with (vLLM's and SGLang's spellings)
_RENDERING_FLAGS = ("--chat-template", "--chat-template-content-format", "--default-chat-template-kwargs",
                    "--tokenizer", "--tokenizer-mode", "--tokenizer-path", "--exclude-tools-when-tool-choice-none")


def renders_otherwise(args: "Sequence[str]") -> str | None:
    """The first flag in an engine's ``args`` that makes it render or tokenize prompts otherwise
    than its model directory says (the router's count would not be the engine's), or None."""
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in _RENDERING_FLAGS:
            return flag
    return None


# Architectures vLLM 0.32 renders with a renderer of its own, not the HF chat template, without any
# flag (config/model.py: "Set default tokenizer modes based on model architecture")
_OWN_RENDERERS = frozenset({
    "MoonshotKimiaForCausalLM", "KimiK3ForConditionalGeneration", "DeepseekV32ForCausalLM",
    "DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration", "DeepseekV41ForCausalLM",
    "InklingForCausalLM", "InklingForConditionalGeneration"})


def renders_itself(model: Path) -> str | None:
    """Why vLLM renders this model directory's chats without its HF tokenizer's template, unasked,
    or None: a Mistral-format directory (mistral_common's tokenizer: tokenizers/registry.py), a
    gpt-oss model (Harmony: renderers/online_renderer.py), an architecture with its own renderer."""
    if any(model.glob("consolidated*.safetensors")) and (
            (model / "tekken.json").is_file() or any(model.glob("tokenizer.model.v*"))):
        return "a Mistral-format model directory (vLLM uses mistral_common's tokenizer)"
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("model_type") == "gpt_oss":
        return "a gpt-oss model (vLLM renders it with Harmony)"
    archs = config.get("architectures")
    own = [a for a in archs if a in _OWN_RENDERERS] if isinstance(archs, list) else []
    return f"architecture {own[0]} (vLLM renders it with its own renderer)" if own else None


def _prompt_chars(parsed: "ParsedRequest") -> int:
    body = parsed.body
    if parsed.route == "completion":
        p = body.get("prompt")
        return len(p) if isinstance(p, str) else len(p[0]) if isinstance(p, list) and p and isinstance(p[0], str) else 0
    # the estimate's characters: every message's text, its text parts' included (protocol/requests.py
    # check_messages); tools and documents are rendered into the prompt too, unsized there: a chat
    # that has them is tokenized on the pool (a long list of parts or tools stalled the event loop)
    chars = int(parsed.prompt_tokens * CHARS_PER_TOKEN)
    for m in body["messages"]:  # an assistant turn's tool-call arguments are rendered too
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            chars += sum(len(a) for c in calls if isinstance(c, dict) and isinstance(f := c.get("function"), dict)
                         and isinstance(a := f.get("arguments"), str))
    return chars + INLINE_CHARS if body.get("tools") or body.get("documents") else chars


class Tokenizer(Protocol):
    """What the router needs of a model's tokenizer (:class:`~narwhal_serve.tokenization.hf.HfTokenizer`,
    or the simulator's)."""

    source: str
    vocab_size: int
    max_model_len: int | None

    def prompt(self, route: str, body: dict[str, Any]) -> "Encoded": ...
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def token_strs(self, ids: list[int]) -> list[str | None]: ...


@dataclass(frozen=True)
class Sized:
    parsed: "ParsedRequest"
    ids: list[int] | None  # the router's own prompt token IDs (exact), or None (estimated)
    method: str  # "tokenizer" | "client_ids" | "estimate"

    @property
    def exact(self) -> bool:
        """Whether the prompt's size is the engine's own count: its IDs known (``ids``: as the
        engine keeps them), and not cut to a length the engine picks (``truncate_prompt_tokens``
        -1: its context less one; the tokenizer path sizes no cut prompt, :func:`engine_kept`)."""
        return self.ids is not None and (self.parsed.body.get("truncate_prompt_tokens") is None
                                         or truncated_to(self.parsed.body) is not None)


def tokenizer_at(path: str | None) -> "Tokenizer | None":
    """The tokenizer :func:`tokenizer_path` names (None: the estimate)."""
    if path is None:
        return None
    if path == SIM:
        from narwhal_serve.sim.tokenizer import SimTokenizer  # the simulated engines' own functions

        return SimTokenizer()
    from narwhal_serve.tokenization.hf import HfTokenizer

    return HfTokenizer(path)


class PromptSizer:
    def __init__(self, tokenizer: "Tokenizer | None") -> None:
        self.tokenizer = tokenizer
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, cfg: "NarwhalConfig") -> "PromptSizer":
        return cls(tokenizer_at(tokenizer_path(cfg)))

    @property
    def source(self) -> str:
        return self.tokenizer.source if self.tokenizer is not None else ESTIMATE

    async def encode(self, route: str, body: dict[str, Any], chars: int) -> "Encoded":
        """The prompt token IDs of a validated ``body`` (``chars``: about how long its prompt is), off
        the event loop when long; raises :class:`NotExact` where the router cannot say exactly."""
        tok = self.tokenizer
        assert tok is not None
        if chars <= INLINE_CHARS:
            return tok.prompt(route, body)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="narwhal-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._pool, tok.prompt, route, body)

    async def size(self, parsed: "ParsedRequest") -> Sized:
        if parsed.prompt_token_ids is not None:
            kept, skipped = engine_kept(parsed.prompt_token_ids, parsed.body)
            vocab = self.tokenizer.vocab_size if self.tokenizer is not None else None
            bad = None if vocab is None else outside_vocabulary(kept, vocab)
            if bad is not None:  # the engine would refuse it (or fail on it): say which one, up front
                bad += skipped
                path = f"prompt.{bad}" if not isinstance(parsed.body["prompt"][0], list) else f"prompt.0.{bad}"
                raise InvalidRequest(f"'{path}' is not a token id of this model (vocabulary {vocab})", param=path)
            return Sized(parsed, kept, "client_ids")
        if self.tokenizer is None or parsed.body.get("truncate_prompt_tokens") is not None:
            return Sized(parsed, None, ESTIMATE)  # (a text prompt the engine cuts: its tokenizer keeps special tokens)
        try:
            ids = (await self.encode(parsed.route, parsed.body, _prompt_chars(parsed))).ids
        except NotExact:
            return Sized(parsed, None, ESTIMATE)
        except Exception:  # a tokenizer fault must not fail the request: the engine still sizes it
            log.exception("tokenizing a prompt failed; sizing it with the estimate")
            return Sized(parsed, None, ESTIMATE)
        return Sized(dataclasses.replace(parsed, prompt_tokens=max(1, len(ids)), own_ids=tuple(ids)), ids, "tokenizer")


def engine_kept(ids: "Sequence[int]", body: dict[str, Any]) -> tuple[list[int], int]:
    """Prompt token IDs as a generating vLLM engine keeps them under ``truncate_prompt_tokens`` N
    ≥ 1 (vLLM 0.32 renderers/params.py ``_truncation_slice``; the IDs it checks are those kept):
    the last N, the first N with ``truncation_side: "right"`` (a generating model's tokenizer
    truncates on the left); else as sent.  With how many were cut off their start.  (A text prompt
    is cut by the tokenizer itself, special tokens kept: not sized here.)"""
    keep = truncated_to(body)
    if keep is None or keep >= len(ids):
        return list(ids), 0
    if body.get("truncation_side") == "right":
        return list(ids[:keep]), 0
    return list(ids[len(ids) - keep:]), len(ids) - keep


def outside_vocabulary(ids: "Sequence[int]", vocab: int) -> int | None:
    """The position of the first ID that is not a token of a ``vocab``-token model, or None."""
    return next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
