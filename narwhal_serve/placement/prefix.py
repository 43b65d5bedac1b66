"""Prefix-aware placement: which engine already holds a request's prompt prefix (its KV blocks).

Like vLLM's own prefix cache, a prompt is cut into blocks and each block's hash chains the hashes
before it, so equal hashes mean equal prefixes.  Without the model's tokenizer the router's blocks
are of characters (``placement.prefix_block_chars``; chat messages with their roles) or,
for a prompt given as token IDs, of tokens (``placement.prefix_block_tokens``).  Hashes are stable
across processes (BLAKE2b), since ingress replicas and the scheduler compute and compare them.
Where the router has the model's tokenizer (``tokenizer:``), every prompt comes as token IDs.

Each engine has a bounded index (:class:`PrefixIndex`) of the blocks of the prompts the router
placed there, least recently placed evicted first — a model of the engine's cache, which evicts
on its own; the TTFT projection credits a match as cached tokens, so a wrong guess costs only a
prediction that the engine then corrects by measurement.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import sys
from array import array
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from narwhal_serve.protocol.estimate import CHARS_PER_TOKEN
from narwhal_serve.protocol.requests import TEXT_PART_TYPES, part_text_key

KV_SHARE = 0.8  # of an engine's KV cache, what the index assumes cached prefixes keep (running sequences use the rest)
CREDIT_PRIOR = 0.8  # how often a believed prefix hit is a real one, before any measurement
CREDIT_EWMA = 0.1


def index_capacity(configured: int, kv_tokens: int, block_tokens: float) -> int:
    """Blocks an engine's index keeps: the configured cap, or what the engine's KV cache holds
    (``vllm:cache_config_info``: block_size × num_gpu_blocks) if it says less — an index that
    remembers more than the engine keeps would credit prefixes the engine evicted."""
    if kv_tokens <= 0 or block_tokens <= 0:
        return configured
    return max(1, min(configured, int(kv_tokens * KV_SHARE / block_tokens)))


def was_hit(measured: float, predicted_hit: float, predicted_miss: float) -> bool:
    """Whether a request credited with a cached prefix behaved like a hit: its measured TTFT is
    closer to the prediction with the credit than to the one without."""
    return abs(measured - predicted_hit) <= abs(measured - predicted_miss)


def _chain(blocks: Iterable[bytes]) -> tuple[int, ...]:
    out: list[int] = []
    prev = b""
    for block in blocks:
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return tuple(out)


_ID_WIDTH = array("Q").itemsize
_BIG_ENDIAN = sys.byteorder != "little"


def id_bytes(ids: Sequence[int]) -> bytes:
    """Token IDs as little-endian unsigned 64-bit integers (hashes are compared across processes)."""
    a = array("Q", ids)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def _id_block(ids: Sequence[int]) -> bytes:
    """A token-ID block's bytes: the IDs as unsigned 64-bit integers (a tenth of the cost of their
    decimal digits), or, for an ID past 2^64 (a client's: no engine has one), its digits."""
    try:
        return b"i" + id_bytes(ids)
    except OverflowError:
        return b"I" + ",".join(map(str, ids)).encode()


def next_id_block_hash(prev: int | None, ids: Sequence[int]) -> int:
    """The hash of the token-ID block ``ids`` after the block hashed ``prev`` (None: the first block):
    one step of :func:`id_block_hashes`, for an index that learns blocks one at a time (KV events)."""
    seed = b"" if prev is None else prev.to_bytes(8, "big")
    return int.from_bytes(hashlib.blake2b(seed + _id_block(ids), digest_size=8).digest(), "big")


def text_block_hashes(text: str, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the full ``block_chars``-character blocks of ``text`` (at most ``max_blocks``)."""
    n = min(len(text) // block_chars, max_blocks)
    return _chain(text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass") for i in range(n))


def id_block_hashes(ids: Sequence[int], block_tokens: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the full ``block_tokens``-token blocks of a token-ID prompt."""
    n = min(len(ids) // block_tokens, max_blocks)
    try:  # one conversion for the whole prefix, then a slice per block: the same bytes as _id_block's
        raw = id_bytes(ids[:n * block_tokens])
    except OverflowError:
        return _chain(_id_block(ids[i * block_tokens:(i + 1) * block_tokens]) for i in range(n))
    step = _ID_WIDTH * block_tokens
    return _chain(b"i" + raw[i * step:(i + 1) * step] for i in range(n))


def _digest(value: Any) -> str:
    """A short stand-in for what a template renders that the text does not show (media, tools)."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


MEDIA_SAMPLE = 4096  # of a media part's data: its length, and this much of its start and of its end


def _media_digest(part: Any) -> str:
    """A media part by a digest of its data (an image's URL or base64 bytes: its length, start and
    end — a whole 4 MB image JSON-encoded and hashed cost ~24 ms a request on the event loop)."""
    if not isinstance(part, dict):
        return _digest(part)
    value = part.get(part.get("type")) if isinstance(part.get("type"), str) else None
    if isinstance(value, dict):
        value = value.get("url", value.get("data", value))
    if not isinstance(value, str):
        return _digest(part)
    key = f"{part.get('type')}:{len(value)}:{value[:MEDIA_SAMPLE]}:{value[-MEDIA_SAMPLE:]}"
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts in order: their text (the text parts the request
        out = []                   # check takes), each other part by a digest of it (an image's data)
        for p in content:
            text = p if isinstance(p, str) else p.get(part_text_key(p)) if (
                isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES) else None
            out.append(text if isinstance(text, str) else f"\x1c{_media_digest(p)}")
        return "\n".join(out)  # (as vLLM joins a message's parts)
    return ""


def _message_text(m: dict[str, Any]) -> str:
    calls, name = m.get("tool_calls"), m.get("name")
    named = "\x1d" + name if isinstance(name, str) else ""
    called = "\x1b" + _digest(calls) if calls else ""
    return f"\x1e{m.get('role', '')}{named}\x1f{_content_text(m.get('content'))}{called}"


def prompt_text(route: str, body: dict[str, Any], limit: int | None = None) -> str | None:
    """The prompt as the prefix index reads it: chat messages with their roles (and names, tool
    calls, media parts by a digest of them), after a digest of what the template renders before
    them (tools, documents, template arguments: two chats that differ there share no block); or
    the prompt string.  ``limit``: the characters that are hashed (a chat's later messages are not
    read past it)."""
    if route == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        rendered = {k: body[k] for k in ("tools", "documents", "chat_template_kwargs") if body.get(k)}
        parts = [f"\x1d{_digest(rendered)}"] if rendered else []
        size = len(parts[0]) if parts else 0
        for m in msgs:
            if limit is not None and size >= limit:
                break
            if isinstance(m, dict):
                parts.append(text := _message_text(m))
                size += len(text)
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return str(prompt[0])
    return None


def request_prefix(route: str, body: dict[str, Any], ids: Sequence[int] | None, block_chars: int,
                   block_tokens: int, max_blocks: int) -> tuple[tuple[int, ...], float]:
    """A request's block hashes and the prompt tokens one block stands for.  None for a request
    with a ``cache_salt``: vLLM mixes the salt into its blocks' hashes, so it shares no cache with
    an unsalted request (nor is it one to learn from)."""
    if body.get("cache_salt") is not None:
        return (), 0.0
    if ids is not None:
        return id_block_hashes(ids, block_tokens, max_blocks), float(block_tokens)
    if body.get("truncate_prompt_tokens") is not None:
        return (), 0.0  # a text the engine cuts (its last N tokens): its characters' blocks are not what it holds
    text = prompt_text(route, body, block_chars * max_blocks)
    if text is None:
        return (), 0.0
    return text_block_hashes(text, block_chars, max_blocks), block_chars / CHARS_PER_TOKEN


def matched_blocks(held: AbstractSet[int], hashes: Sequence[int]) -> int:
    """Leading blocks of ``hashes`` that ``held`` has (the longest cached prefix).  Looked up at C
    speed (a 12 k-token prompt is ~190 blocks, and a decision matches a few dozen engines)."""
    return len(list(itertools.takewhile(bool, _holds(held, hashes))))


def _holds(held: AbstractSet[int], hashes: Sequence[int]) -> Iterator[bool]:
    if isinstance(held, SetUnion):
        return map(operator.or_, _holds(held._a, hashes), _holds(held._b, hashes))
    return map(held.__contains__, hashes)


class SetUnion(AbstractSet[int]):
    """Two sets of blocks read as one (no copy): held and pending ones, or a lease's view and the
    blocks its holder placed since."""

    def __init__(self, a: AbstractSet[int], b: AbstractSet[int]) -> None:
        self._a, self._b = a, b

    def __contains__(self, h: object) -> bool:
        return h in self._a or h in self._b

    def __iter__(self) -> Iterator[int]:
        yield from self._a
        yield from (h for h in self._b if h not in self._a)

    def __len__(self) -> int:
        return len(self._a) + sum(1 for h in self._b if h not in self._a)


class PrefixIndex:
    """One engine's blocks, bounded to ``capacity``, least recently placed or used evicted first;
    and the *pending* blocks of requests placed there whose prefill has not finished (reference
    counted)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._pending: Counter[int] = Counter()
        self._blocks: OrderedDict[int, None] = OrderedDict()
        # frozen(): the most recent blocks (until the blocks change), and with the pending ones (until
        # what it holds changes: a request pending on blocks held already, a pending block stored, a
        # block used again while every block is in the copy change nothing)
        self._recent: frozenset[int] | None = frozenset()
        self._frozen: frozenset[int] | None = frozenset()
        self._frozen_limit = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _whole(self) -> bool:
        """Every block is among the most recent ones the frozen copy holds."""
        return len(self._blocks) <= self._frozen_limit

    def _in_copy(self, hashes: Collection[int]) -> bool:
        """All of ``hashes`` are among the blocks the frozen copy holds as held (False: not known)."""
        if self._recent is not None:
            return self._recent.issuperset(hashes)
        return self._whole() and self._blocks.keys() >= (hashes if isinstance(hashes, AbstractSet) else set(hashes))

    def insert(self, hashes: Sequence[int]) -> None:
        if not hashes or self.capacity <= 0:
            return
        blocks, pending = self._blocks, self._pending
        new = False  # a block neither held nor pending before: the copy holds more
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                new = new or h not in pending
                blocks[h] = None
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            new = new or h not in pending  # (one evicted and not pending: the copy holds less)
        self._recent = None
        if new or not self._whole():  # (a block may have left the most recent ones)
            self._frozen = None

    def learn(self, prompt: Sequence[int]) -> None:
        """A prompt's blocks, learned as held (an engine without KV events, where the router sent
        it): its first block last, so the prompt's start is the most recent — blocks chain, a
        prompt matches from its first block only, and an engine frees a request's tail first (in
        prompt order, a full index evicted the starts and kept tails no prompt can match)."""
        self.insert(prompt[::-1])

    def touch(self, hashes: Iterable[int]) -> None:
        """A request just used these blocks here (its prefill is done): those held become the most
        recently used, as in the engine's own cache, whose least recently used free blocks are
        evicted first.  An index fed by the engine's KV events hears of a block only when it is
        stored, so without this a prefix every request hits (a system prompt) would count as
        old, and leave the ``frozen`` view's most recent blocks as soon as newer ones were
        stored, while the engine keeps it."""
        blocks = self._blocks
        held = [h for h in hashes if h in blocks]
        for h in held:
            blocks.move_to_end(h)
        if self._whole():  # (all of them are in the copy, in any order)
            return
        if self._recent is not None and not self._recent.issuperset(held):
            self._recent = self._frozen = None

    def remove(self, hashes: Iterable[int]) -> None:
        blocks, pending = self._blocks, self._pending
        for h in hashes:
            whole = self._whole()  # (before: with more blocks than the copy carries, an older one enters it)
            if blocks.pop(h, 0) is None:
                self._recent = None
                if h not in pending or not whole:
                    self._frozen = None

    def resize(self, capacity: int) -> None:
        if capacity != self.capacity:
            self.capacity = capacity
            while len(self._blocks) > max(0, capacity):
                self._blocks.popitem(last=False)
            self._recent = self._frozen = None

    def clear(self) -> None:
        self._blocks.clear()
        self._recent = self._frozen = None  # (pending blocks stay)

    def pend(self, hashes: Iterable[int]) -> None:
        """A request placed here with these blocks, its prefill not done yet."""
        hashes = hashes if isinstance(hashes, (tuple, list)) else tuple(hashes)
        if self._frozen is not None:  # (a block newly pending and not held changes it)
            fresh = set(hashes).difference(self._pending)
            if fresh and not self._in_copy(fresh):
                self._frozen = None
        self._pending.update(hashes)  # (counted in C)

    def unpend(self, hashes: Iterable[int]) -> None:
        pending, get, gone = self._pending, self._pending.get, []
        for h in hashes:
            n = get(h)
            if n is None:
                continue
            if n > 1:
                pending[h] = n - 1
            else:
                pending.pop(h)  # (dict's own: Counter's `del` is Python code)
                gone.append(h)
        # (one look for them all: what the copy holds as held does not change while pending ones leave)
        if gone and self._frozen is not None and not self._in_copy(gone):
            self._frozen = None

    def unpend_stored(self, hashes: Iterable[int]) -> tuple[int, ...]:
        """Those of these blocks that are held leave pending; the others are returned (not stored
        yet), in their order."""
        blocks = self._blocks
        hashes = tuple(hashes)
        later = tuple(h for h in hashes if h not in blocks)
        self.unpend([h for h in hashes if h in blocks] if later else hashes)
        return later

    def stored(self, h: int) -> bool:
        """Held (placed, or named by the engine's events), pending or not."""
        return h in self._blocks

    @property
    def pending(self) -> int:
        return len(self._pending)

    def held(self) -> AbstractSet[int]:
        """A live read-only view (for decisions made here): held and pending blocks."""
        return SetUnion(self._blocks.keys(), self._pending.keys()) if self._pending else self._blocks.keys()

    def frozen(self, limit: int) -> frozenset[int]:
        """A copy of the ``limit`` most recently placed or used blocks and the pending ones, for a
        fleet view that crosses the Ray hop (cached until the next change)."""
        if self._frozen_limit != limit:
            self._recent = self._frozen = None
            self._frozen_limit = limit
        if self._frozen is None:
            recent = self._recent
            if recent is None:
                blocks = self._blocks
                if len(blocks) <= limit:  # (all of them: read from the dict's table, not its order's links)
                    recent = frozenset(blocks)
                else:
                    recent = frozenset(itertools.islice(reversed(blocks), limit)) if limit > 0 else frozenset()
                self._recent = recent
            self._frozen = recent.union(self._pending) if self._pending else recent
        return self._frozen
