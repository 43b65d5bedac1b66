"""A tokenization cache keyed by the text between special tokens.

A Hugging Face tokenizer splits its input on its added special tokens before anything else, and
encodes each piece between them on its own: a rendered chat prompt is ``<|user|>`` + message +
``<|end|>`` + …, so each message's text is tokenized independently of the others.  Caching the
pieces means a conversation's earlier turns and a shared system prompt are tokenized once, and a
request costs only what is new in it.

That holds only for some tokenizers, so :func:`segmenter` turns the cache on only when it can see it
is exact: no normalizer (it could rewrite text across a piece boundary), a byte-level pre-tokenizer
without a prefix space (none added to every piece), added tokens matched as they are (no lstrip,
rstrip, single-word or normalized matching) — and then a self-check on sample texts must give the
same IDs both ways.  Otherwise the tokenizer encodes whole texts as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from narwhal_serve.tokenization.cache import CACHE_TOKENS, TokenCache

MIN_CACHED_CHARS = 256  # shorter pieces are encoded each time (cheaper than hashing and bookkeeping)
MIN_SEGMENTED_CHARS = 1024  # shorter texts are encoded whole


class SegmentCache:
    """Encodes texts piece by piece between special tokens, caching long pieces (thread-safe)."""

    def __init__(self, rust: Any, specials: dict[str, int], prefix: list[int], suffix: list[int],
                 capacity_tokens: int = CACHE_TOKENS) -> None:
        self._ids = specials
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
        self._prefix, self._suffix = prefix, suffix
        self._piece = TokenCache(lambda text: list(rust.encode(text, add_special_tokens=False).ids),
                                 MIN_CACHED_CHARS, capacity_tokens)

    @property
    def hits(self) -> int:
        return self._piece.hits

    @property
    def misses(self) -> int:
        return self._piece.misses

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        out: list[int] = list(self._prefix) if add_special_tokens else []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._ids[part])
            elif part:
                out.extend(self._piece(part))
        if add_special_tokens:
            out.extend(self._suffix)
        return out


def _exact_by_construction(rust: Any) -> bool:
    cfg = json.loads(rust.to_str())
    if cfg.get("normalizer") is not None:
        return False
    pre = cfg.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
    if not byte_level or any(p.get("add_prefix_space") for p in byte_level):
        return False
    if any(p.get("type") not in ("ByteLevel", "Split", "Digits", "Punctuation") for p in parts):
        return False
    for tok in cfg.get("added_tokens", ()):
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word") or tok.get("normalized"):
            return False
    return True


def _specials_and_wrapping(rust: Any) -> tuple[dict[str, int], list[int], list[int]] | None:
    specials = {t.content: i for i, t in rust.get_added_tokens_decoder().items()}
    if not specials:
        return None
    probe = "segment probe"
    bare = list(rust.encode(probe, add_special_tokens=False).ids)
    full = list(rust.encode(probe, add_special_tokens=True).ids)
    at = next((k for k in range(len(full) - len(bare) + 1) if full[k:k + len(bare)] == bare), None)
    if at is None:
        return None
    return specials, full[:at], full[at + len(bare):]


def segmenter(rust: Any, samples: Sequence[str]) -> SegmentCache | None:
    """A :class:`SegmentCache` for ``rust`` if piece-wise encoding is exact for it (checked on
    ``samples``, with and without special tokens), else None."""
    if not _exact_by_construction(rust):
        return None
    parts = _specials_and_wrapping(rust)
    if parts is None:
        return None
    check = SegmentCache(rust, *parts)
    for text in samples:
        for special in (False, True):
            if check.encode(text, special) != list(rust.encode(text, add_special_tokens=special).ids):
                return None
    return SegmentCache(rust, *parts)  # (an empty cache: the samples are not requests)
