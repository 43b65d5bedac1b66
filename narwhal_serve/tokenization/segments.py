"""A tokenization cache keyed by the text between special tokens.

A Hugging Face tokenizer splits its input on its added special tokens before anything else, and
encodes each piece between them on its own: a rendered chat prompt is ``<|user|>`` + message +
``<|end|>`` + …, so each message's text is tokenized independently of the others.  Caching the
pieces means a conversation's earlier turns and a shared system prompt are tokenized once, and a
request costs only what is new in it.

That holds only for some tokenizers, so :func:`segmenter` turns the cache on only when it can see it
is exact: no normalizer (it could rewrite text across a piece boundary), a byte-level pre-tokenizer
without a prefix space (none added to every piece), added tokens matched as they are (no lstrip,
rstrip or single-word matching) — and then a self-check on sample texts must give the
same IDs both ways.  Otherwise the tokenizer encodes whole texts as before.

A long piece (a long completion prompt, a long message) is cut again into blocks of about
:data:`CHUNK_CHARS`, each ending before a space that sits between two ASCII letters ("word| word"):
a byte-level pre-tokenizer's word patterns (GPT-2's, Llama 3's, Qwen's) never take a letter and
the space after it into one word, and BPE never merges across words, so each block encodes alone
to exactly its share of the whole.  The blocks are cached like pieces, so a long prompt that shares
a long start with an earlier one (few-shot examples, a document asked about again, a conversation
sent as one message) is tokenized only from its last shared block on; the blocks not cached are
encoded in one batch (spread over the cores the Rust tokenizer has where ``TOKENIZERS_PARALLELISM``
allows it; :mod:`.hf` leaves it off unless the environment says otherwise).  Cut this way only
where the pre-tokenizer makes the same words of the blocks as of the whole text, and a second
self-check, cutting at every such space, agrees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from narwhal_serve.tokenization.cache import CACHE_TOKENS, TokenCache

MIN_CACHED_CHARS = 256  # shorter pieces are encoded each time (cheaper than hashing and bookkeeping)
MIN_SEGMENTED_CHARS = 1024  # shorter texts are encoded whole
CHUNK_CHARS = 1024  # a piece at least twice this long is encoded in blocks of about this many characters
_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")  # where a block may end: before a space between two letters


class SegmentCache:
    """Encodes texts piece by piece between special tokens, caching long pieces (thread-safe)."""

    def __init__(self, rust: Any, specials: dict[str, int], prefix: list[int], suffix: list[int],
                 capacity_tokens: int = CACHE_TOKENS, chunk_chars: int = CHUNK_CHARS) -> None:
        self._rust = rust
        self.chunk_chars = chunk_chars  # 0: pieces are not cut
        self._ids = specials
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
        self._prefix, self._suffix = prefix, suffix
        self._piece = TokenCache(self._encode_one, MIN_CACHED_CHARS, capacity_tokens)

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
            elif self.chunk_chars and len(part) >= 2 * self.chunk_chars:
                for ids in self._piece.many(self.blocks(part), self._encode_many):
                    out.extend(ids)
            elif part:
                out.extend(self._piece(part))
        if add_special_tokens:
            out.extend(self._suffix)
        return out

    def blocks(self, piece: str) -> list[str]:
        """``piece`` cut before the first space between two letters at least ``chunk_chars`` into
        each block (the same start always gives the same blocks, whatever follows)."""
        out: list[str] = []
        start, n = 0, len(piece)
        while start + self.chunk_chars < n:
            cut = _CUT.search(piece, start + max(1, self.chunk_chars))
            if cut is None:
                break
            out.append(piece[start:cut.start()])
            start = cut.start()
        out.append(piece[start:])
        return out

    def _encode_one(self, text: str) -> list[int]:
        return list(self._rust.encode(text, add_special_tokens=False).ids)

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        if len(texts) == 1:
            return [self._encode_one(texts[0])]
        return [list(e.ids) for e in self._rust.encode_batch(texts, add_special_tokens=False)]


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
    # (an added token matched on the normalized text, GPT-2's <|endoftext|>, is matched as written:
    # there is no normalizer here)
    for tok in cfg.get("added_tokens", ()):
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
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


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# every pair of ASCII letters around a space, and contractions and capitals around spaces
_WORD_PROBE = " ".join(a + b for a in _LETTERS for b in _LETTERS) + " it's a I'M ok we'll go x'd y A'S b don't Ab"


def _splits_between_words(rust: Any, samples: Sequence[str] = ()) -> bool:
    """Whether ``rust``'s pre-tokenizer makes the same words of a text cut at every space between
    two ASCII letters, block by block, as of the whole text (so BPE, which merges within a word
    only, gives each block exactly its share): on every pair of letters around a space, and on
    ``samples``.  A tokenizer whose words may span spaces (a byte-level pre-tokenizer without its
    regex, as SuperBPE's "superword" tokenizers have: merges like "Ġto" + "Ġthe") fails it,
    whatever its samples' IDs show (found by a fuzzing review)."""
    pre = rust.pre_tokenizer
    if pre is None:
        return False

    def words(text: str) -> list[str]:
        return [w for w, _ in pre.pre_tokenize_str(text)]

    for text in (_WORD_PROBE, *samples):
        cuts = [0, *(m.start() for m in _CUT.finditer(text)), len(text)]
        if words(text) != [w for a, b in zip(cuts, cuts[1:]) if b > a for w in words(text[a:b])]:
            return False
    return True


def segmenter(rust: Any, samples: Sequence[str]) -> SegmentCache | None:
    """A :class:`SegmentCache` for ``rust`` if piece-wise encoding is exact for it (checked on
    ``samples``, with and without special tokens), else None."""
    if not _exact_by_construction(rust):
        return None
    parts = _specials_and_wrapping(rust)
    if parts is None:
        return None
    check = SegmentCache(rust, *parts, chunk_chars=0)
    for text in samples:
        for special in (False, True):
            if check.encode(text, special) != list(rust.encode(text, add_special_tokens=special).ids):
                return None
    # blocks: only where the pre-tokenizer itself starts a word at every place a block may end, and
    # then cut at every such place in the samples (a block of one character at least)
    cut = SegmentCache(rust, *parts, chunk_chars=1)
    chunked = _splits_between_words(rust, samples) and all(
        cut.encode(text, special) == list(rust.encode(text, add_special_tokens=special).ids)
        for text in samples for special in (False, True))
    return SegmentCache(rust, *parts, chunk_chars=CHUNK_CHARS if chunked else 0)  # (empty: samples are not requests)
