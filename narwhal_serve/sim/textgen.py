"""Deterministic toy tokenizer and text generator.

* A fixed vocabulary of :data:`VOCAB_SIZE` word pieces (a few specials, then syllables).
* Prompt text is split into chunks of at most 4 characters (a space sticks to the chunk after it);
  a chunk that is a vocabulary piece gets that id, any other a stable hash into the vocabulary.
* Output tokens come from a :class:`random.Random` seeded from (engine seed, request seed or a
  hash of the prompt ids), so a request gives the same tokens streamed or not.
* Greedy requests (``temperature: 0``) are a function of their context alone, as a model's are: each
  token is drawn from a hash of every token before it (prompt and output), on any engine.  So a
  continuation whose prompt is the prompt plus the first k output tokens generates exactly the
  tokens after them (docs/contract.md, "Engine failures").
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BOS_ID = 0
PAD_ID = 1
EOS_ID = 2
IM_START_ID = 3
IM_END_ID = 4
NEWLINE_ID = 5
SPECIALS: tuple[str, ...] = ("<s>", "<pad>", "</s>", "<|im_start|>", "<|im_end|>", "\n")
FIRST_WORD_ID = len(SPECIALS)
VOCAB_SIZE = 2048


def _build_vocab() -> tuple[str, ...]:
    onsets = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "z", "ch", "sh", "th")
    nuclei = ("a", "e", "i", "o", "u", "ou")
    codas = ("", "n", "r", "s", "t", "l", "m", "x")
    pieces: list[str] = list(SPECIALS)
    seen: set[str] = set(pieces)
    for space in (" ", ""):
        for coda in codas:
            for onset in onsets:
                for nucleus in nuclei:
                    piece = space + onset + nucleus + coda
                    if piece not in seen and len(pieces) < VOCAB_SIZE:
                        seen.add(piece)
                        pieces.append(piece)
    return tuple(pieces)


VOCAB: tuple[str, ...] = _build_vocab()
_PIECE_ID: dict[str, int] = {p: i for i, p in enumerate(VOCAB)}
_CHUNK_RE = re.compile(r"\s?\S{1,3}|\s")


def stable_hash(*parts: object) -> int:
    """A process-independent 64-bit hash of the ``repr`` of ``parts``."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


_HASHED: dict[str, int] = {}  # fragments outside the vocabulary, hashed once (bounded)
_HASHED_MAX = 1 << 16


def piece_id(text: str) -> int:
    """Token id of one text fragment: its vocabulary id, else a stable hash into the vocabulary."""
    known = _PIECE_ID.get(text)
    if known is not None:
        return known
    known = _HASHED.get(text)
    if known is None:
        known = FIRST_WORD_ID + stable_hash("piece", text) % (VOCAB_SIZE - FIRST_WORD_ID)
        if len(_HASHED) >= _HASHED_MAX:
            _HASHED.clear()
        _HASHED[text] = known
    return known


def split_chunks(text: str) -> list[str]:
    """The prompt-tokenizer split: chunks of at most 4 characters, a space leading its chunk."""
    return list(_CHUNK_RE.findall(text))


def tokenize_text(text: str) -> list[int]:
    vocab, hashed = _PIECE_ID.get, _HASHED.get
    out = []
    for chunk in _CHUNK_RE.findall(text):
        i = vocab(chunk)
        if i is None:
            i = hashed(chunk)
            if i is None:
                i = piece_id(chunk)
        out.append(i)
    return out


def token_str(token_id: int) -> str:
    return VOCAB[token_id] if 0 <= token_id < VOCAB_SIZE else ""


def encode_prompt(prompt: str, add_special_tokens: bool = True) -> list[int]:
    return ([BOS_ID] if add_special_tokens else []) + tokenize_text(prompt)


def render_chat(messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True,
                tokenize: Callable[[str], list[int]] = tokenize_text) -> list[int]:
    """ChatML-like template: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message (each
    content tokenized on its own: ``tokenize`` may be a cache of :func:`tokenize_text`)."""
    ids: list[int] = []
    for role, content in messages:
        ids += [IM_START_ID, *tokenize_text(role), NEWLINE_ID, *tokenize(content), IM_END_ID, NEWLINE_ID]
    if add_generation_prompt:
        ids += [IM_START_ID, *tokenize_text("assistant"), NEWLINE_ID]
    return ids


@dataclass(frozen=True)
class GenToken:
    """One generated token: raw vocabulary string, the visible text delta, and logprob data."""

    token_id: int
    token: str
    text: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    """Alternatives (distinct strings, never the sampled one), for top-logprob lists."""


@dataclass(frozen=True)
class Generation:
    tokens: tuple[GenToken, ...]
    finish_reason: str
    stop_reason: str | None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


_MASK = (1 << 64) - 1
_FNV_OFFSET, _FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def _chain(h: int, token: int) -> int:
    return ((h ^ (token + 1)) * _FNV_PRIME) & _MASK


def context_hash(ids: Sequence[int]) -> int:
    """A rolling hash of a token sequence: extending it by one token is :func:`_chain`."""
    h = _FNV_OFFSET
    for t in ids:
        h = _chain(h, t)
    return h


def request_rng_seed(engine_seed: int, request_seed: int | None, prompt_ids: Sequence[int]) -> int:
    if request_seed is not None:
        return stable_hash("seed", engine_seed, request_seed)
    return stable_hash("prompt", engine_seed, tuple(prompt_ids))


def _alternatives(rng: random.Random, sampled: str, num_top: int) -> tuple[tuple[str, float], ...]:
    out: list[tuple[str, float]] = []
    used = {sampled}
    while len(out) < num_top:
        cand = VOCAB[rng.randrange(FIRST_WORD_ID, VOCAB_SIZE)]
        if cand in used:
            continue
        used.add(cand)
        out.append((cand, -rng.uniform(0.05, 8.0)))
    out.sort(key=lambda kv: -kv[1])
    return tuple(out)


def _find_stop(full: str, prev_len: int, stop: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that completes earliest in the new text (ties: the first in the list), as
    vLLM 0.32 picks it (v1/engine/detokenizer.py ``check_stop_strings``)."""
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            continue
        pos = full.find(s, max(0, prev_len - len(s) + 1))
        if pos >= 0 and (best is None or pos + len(s) < best[0] + len(best[1])):
            best = (pos, s)
    return best


def generate(
    rng_seed: int,
    *,
    max_tokens: int,
    min_tokens: int = 0,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    eos_prob: float = 0.0,
    num_top: int = 0,
    context: Sequence[int] | None = None,
    include_stop: bool = False,
    ends_itself: bool = False,
) -> Generation:
    """Generate up to ``max_tokens`` tokens; stop strings are cut from the text (vLLM default).
    ``context`` (greedy requests): the prompt IDs, each token then drawn from the whole context.
    ``ends_itself``: ``max_tokens`` is where the model stops by itself (the simulator's stand-in for
    an unbounded request): its last token is an EOS (``stop``), not a cut (``length``)."""
    rng = random.Random(rng_seed)
    lp_rng = random.Random(rng_seed ^ 0x5DEECE66D)
    ids: list[int] = []
    raw: list[str] = []
    full = ""
    finish, stop_reason, cut = "length", None, -1
    h = context_hash(context) if context is not None else 0
    for _ in range(max_tokens):
        if context is not None:
            rng = random.Random(h)
        eos_draw = rng.random()
        tid = rng.randrange(FIRST_WORD_ID, VOCAB_SIZE)
        h = _chain(h, tid)
        natural = ends_itself and len(ids) == max_tokens - 1
        if len(ids) >= min_tokens and not ignore_eos and (eos_draw < eos_prob or natural):
            ids.append(EOS_ID)
            raw.append("")
            finish = "stop"
            break
        prev_len = len(full)
        ids.append(tid)
        raw.append(VOCAB[tid])
        full += VOCAB[tid]
        if len(ids) > min_tokens and stop:  # (vLLM: once past min_tokens, v1/engine/detokenizer.py)
            hit = _find_stop(full, prev_len, stop)
            if hit is not None:
                cut, stop_reason, finish = hit[0] + (len(hit[1]) if include_stop else 0), hit[1], "stop"
                break
    if cut < 0:
        cut = len(full)
    tokens: list[GenToken] = []
    pos = 0
    for tid, piece in zip(ids, raw):
        start, end = min(pos, cut), min(pos + len(piece), cut)
        pos += len(piece)
        tok = "</s>" if tid == EOS_ID else piece
        lp = -lp_rng.uniform(0.05, 8.0)
        tokens.append(GenToken(tid, tok, full[start:end], lp, _alternatives(lp_rng, tok, num_top)))
    return Generation(tuple(tokens), finish, stop_reason)


def fragment_tokens(fragments: Sequence[str], rng_seed: int, num_top: int = 0) -> list[GenToken]:
    """Tokens for scripted text fragments (one token per fragment)."""
    lp_rng = random.Random(rng_seed ^ 0x2545F491)
    out: list[GenToken] = []
    for frag in fragments:
        lp = -lp_rng.uniform(0.05, 8.0)
        out.append(GenToken(piece_id(frag), frag, frag, lp, _alternatives(lp_rng, frag, num_top)))
    return out
