"""A model's own Hugging Face tokenizer, loaded from a local directory (never from a hub).

The directory is what vLLM loads: ``tokenizer.json`` (the Rust ``tokenizers`` model) and
``tokenizer_config.json`` (special tokens, the chat template, or ``chat_template.jinja`` beside it).
Chat prompts are rendered by ``transformers``' ``apply_chat_template`` — the function vLLM itself
calls — with the conversation and keyword arguments vLLM builds (:mod:`.chat`), then encoded with
the Rust tokenizer without special tokens (vLLM's chat default, ``add_special_tokens: false``);
completion prompts are encoded with special tokens unless the request says otherwise.  Long texts go
through a cache of the pieces between special tokens where that is exact (:mod:`.segments`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from narwhal_serve.tokenization.chat import NotExact, content_format, conversation, template_kwargs, tool_dicts
from narwhal_serve.tokenization.segments import MIN_SEGMENTED_CHARS, segmenter

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings; one request is one call


class TokenizerLoadError(Exception):
    pass


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    add_special_tokens: bool


def text_prompt(body: dict[str, Any]) -> str:
    """A completion's prompt text (``"…"`` or ``["…"]``); raises :class:`NotExact` for token IDs."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1:
        p = p[0]
    if not isinstance(p, str):
        raise NotExact("not a text prompt")
    return p


def _model_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _max_model_len(cfg: dict[str, Any], configured: Any) -> int | None:
    for v in (cfg.get("max_position_embeddings"), configured):
        if isinstance(v, int) and 0 < v < 10**9:
            return v
    return None


class HfTokenizer:
    """One model's tokenizer. Thread-safe for encoding (the Rust tokenizer is), so requests can be
    tokenized on a thread pool."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.source = f"hf:{self.path}"
        if not (self.path / "tokenizer.json").is_file():
            raise TokenizerLoadError(f"{self.path}: no tokenizer.json (a Hugging Face tokenizer directory is needed)")
        try:
            from transformers import AutoTokenizer, PythonBackend
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise TokenizerLoadError(f"transformers is not installed: {exc}") from exc
        try:
            self._hf: Any = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as exc:
            raise TokenizerLoadError(f"{self.path}: {type(exc).__name__}: {exc}") from exc
        self._rust: Any = self._hf.backend_tokenizer
        # as transformers' own calls (vLLM's) leave it: a tokenizer.json's truncation or padding
        # is cleared by the first of them, so it never applies to what the engine sees
        self._rust.no_truncation()
        self._rust.no_padding()
        self.chat_template: str | None = self._hf.chat_template if isinstance(self._hf.chat_template, str) else None
        sig = inspect.signature(PythonBackend.apply_chat_template)
        self._base_params = frozenset(p.name for p in sig.parameters.values()
                                      if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))
        model = _model_config(self.path)
        self.max_model_len = _max_model_len(model, getattr(self._hf, "model_max_length", None))
        self.vocab_size = self._vocabulary(model)
        self.segments = segmenter(self._rust, self._samples())

    def _vocabulary(self, model: dict[str, Any]) -> int:
        """One past the largest token ID the engine takes: vLLM 0.32 refuses a prompt's ID only past
        ``max(tokenizer.max_token_id, model vocab_size - 1)`` (renderers/base.py
        ``validate_token_ids``) — the tokenizer's largest ID (its vocabulary, added tokens
        included, or its ``vocab_size`` where larger: tokenizers/hf.py), or the model's own
        vocabulary (config.json ``vocab_size``, a multimodal model's ``text_config``'s), which
        for Qwen-family models has rows no token names."""
        ids = self._rust.get_vocab(with_added_tokens=True).values()
        top = max(ids) + 1 if ids else 0
        with contextlib.suppress(Exception):
            top = max(top, int(self._hf.vocab_size))
        text = model.get("text_config")
        if not isinstance(text, dict):
            text = model
        rows = text.get("vocab_size")
        if isinstance(rows, int) and not isinstance(rows, bool) and 0 < rows < 2**31:
            top = max(top, rows)
        return top

    def _samples(self) -> list[str]:
        """Texts the segment cache must encode exactly as the whole-text path before it is used:
        special tokens at the edges, between spaces and newlines, inside words; a rendered chat."""
        specials = [t.content for t in self._rust.get_added_tokens_decoder().values()]
        body = "Hello  world\n\n  the quick 東京 fox\tdef f(x):\n    return x  \n"
        words = "It's the router's cache: don't drop it, we'll see. A b C d e's f 'll x y'z I'M ok Ab cD"
        out = [body, " " + body + " ", body * 40, words, " " + words + " a", words * 40]
        for sp in specials:
            out += [sp + body + sp, body + sp + body, "a" + sp + "b", " " + sp + " ", "\n" + sp + "\n" + body, sp * 3]
        if self.chat_template is not None:
            with contextlib.suppress(Exception):
                out.append(self.render_chat({"messages": [{"role": "system", "content": body},
                                                          {"role": "user", "content": body * 30}]}))
        return out

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.segments is not None and len(text) >= MIN_SEGMENTED_CHARS:
            return self.segments.encode(text, add_special_tokens)
        return list(self._rust.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._rust.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_strs(self, ids: list[int]) -> list[str | None]:
        return [self._rust.id_to_token(i) for i in ids]

    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt text vLLM renders for a chat request (raises :class:`NotExact`)."""
        template = self.chat_template
        if template is None:
            raise NotExact("the tokenizer has no chat template")
        if body.get("chat_template") is not None:
            raise NotExact("a request-supplied chat template")
        tools = tool_dicts(body.get("tools"))
        conv = conversation(body["messages"], content_format(template), template)
        kwargs = template_kwargs(body, template, self._base_params)
        try:
            text = self._hf.apply_chat_template(conv, tools=tools, chat_template=template, tokenize=False, **kwargs)
        except Exception as exc:  # the template refused the request (the engine will say why)
            raise NotExact(f"the chat template raised: {exc}") from exc
        if not isinstance(text, str):
            raise NotExact("the chat template did not render a string")
        return text

    def prompt(self, route: str, body: dict[str, Any]) -> Encoded:
        """The prompt token IDs the engine will see for a validated request (raises :class:`NotExact`)."""
        if "truncate_prompt_tokens" in body and body["truncate_prompt_tokens"] is not None:
            raise NotExact("truncate_prompt_tokens")
        if route == "chat":
            special = body.get("add_special_tokens", False)
            text = self.render_chat(body)
        else:
            special = body.get("add_special_tokens", True)
            text = text_prompt(body)
        if not isinstance(special, bool):
            raise NotExact("add_special_tokens is not a boolean")
        return Encoded(self.encode(text, special), special)
