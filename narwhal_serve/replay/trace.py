"""What a replay replays: requests from a trace, and the token IDs they stand for.

Traces: the Azure 2023 CSV and the Mooncake FAST'25 JSONL (:func:`load_trace`),
or Narwhal's own JSONL, one request per line::

    {"at_s": 0.25, "input_tokens": 812, "output_tokens": 64,
     "prefix_blocks": [7, 8], "block_tokens": 512, "tenant": "acme", "class": "batch"}

``at_s``: arrival, seconds from the trace's start; ``prefix_blocks`` (optional): ids of the
prompt's leading ``block_tokens``-token blocks (default 512, Mooncake's), equal ids meaning equal
blocks, the rest of the prompt its own; ``tenant`` and ``class`` optional.

A prompt's token IDs are made from its block ids (a block's tokens depend only on its id), so
requests that share leading blocks share that prefix exactly, for the engines' prefix caches and
for the router's index alike; a prompt's own tokens depend on its index in the trace.
"""

from __future__ import annotations

import gzip
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from narwhal_serve.placement.prefix import next_id_block_hash
from narwhal_serve.sim.timing import block_hashes

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids: one per 512-token block of the prompt


@dataclass(frozen=True)
class TraceRecord:
    at_s: float  # arrival, seconds from the trace's start
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: equal ids = equal 512-token prefix blocks


def load_trace(path: Path) -> tuple[TraceRecord, ...]:
    """The Mooncake FAST'25 JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``) or the Azure 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``), gzipped or not."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    out: list[TraceRecord] = []
    with opener(path, "rt", encoding="utf-8") as f:
        first = f.readline()
        if first.lstrip().startswith("{"):
            for line in [first, *f]:
                if line.strip():
                    r = json.loads(line)
                    out.append(TraceRecord(float(r["timestamp"]) / 1000.0, int(r["input_length"]),
                                           int(r["output_length"]), tuple(int(h) for h in r.get("hash_ids", ()))))
        else:
            t0: datetime | None = None
            for line in f:
                ts, ctx, gen = line.strip().split(",")
                when = datetime.fromisoformat(ts[:26])
                t0 = t0 or when
                out.append(TraceRecord((when - t0).total_seconds(), int(ctx), int(gen)))
    out.sort(key=lambda r: r.at_s)
    return tuple(out)


VOCAB = 50_000  # token IDs are below this (any tokenizer's size will do: nothing decodes them)


@dataclass(frozen=True)
class TraceRequest:
    at_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()  # leading shared blocks (ids)
    block_tokens: int = TRACE_BLOCK_TOKENS
    tenant: str = ""
    klass: str = ""


def _own(r: dict[str, Any]) -> TraceRequest:
    return TraceRequest(float(r["at_s"]), int(r["input_tokens"]), int(r["output_tokens"]),
                        tuple(int(b) for b in r.get("prefix_blocks", ())),
                        int(r.get("block_tokens", TRACE_BLOCK_TOKENS)), str(r.get("tenant", "")),
                        str(r.get("class", "")))


def load(path: Path) -> list[TraceRequest]:
    """Any of the three formats, gzipped or not, in arrival order."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        first = f.readline()
        own = first.lstrip().startswith("{") and "input_tokens" in json.loads(first)
        if own:
            out = [_own(json.loads(line)) for line in [first, *f] if line.strip()]
    if not own:
        out = [TraceRequest(r.at_s, r.input_tokens, r.output_tokens, r.hash_ids) for r in load_trace(path)]
    out.sort(key=lambda r: r.at_s)
    return out


def write(path: Path, requests: Sequence[TraceRequest]) -> None:
    """Narwhal's own JSONL (what :func:`load` reads back)."""
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            row: dict[str, Any] = {"at_s": r.at_s, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens}
            if r.blocks:
                row.update(prefix_blocks=list(r.blocks), block_tokens=r.block_tokens)
            if r.tenant:
                row["tenant"] = r.tenant
            if r.klass:
                row["class"] = r.klass
            f.write(json.dumps(row) + "\n")


def block_ids(key: int, n: int) -> list[int]:
    """The ``n`` token IDs of the block (or own suffix) keyed ``key``."""
    k = key & 0xFFFF_FFFF_FFFF
    base = (k * 0x9E3779B1) % VOCAB
    stride = 1 + ((k * 0x85EBCA6B) >> 7) % (VOCAB - 1)  # (two keys alike in both: one in ~2.5e9)
    return ((np.arange(n, dtype=np.int64) * stride + base) % VOCAB).tolist()


@dataclass
class Prompt:
    ids: list[int]
    engine_hashes: list[int]  # the simulated engine's block hashes (its prefix cache, its KV events)
    router_hashes: tuple[int, ...]  # the router's (Ask.prefix, as its tokenizer path makes them)


class Prompts:
    """Token IDs and both sides' block hashes of trace prompts; shared blocks hashed once (a
    bounded memo keyed by the chain so far)."""

    def __init__(self, engine_block: int, router_block: int, router_max_blocks: int, memo: int = 65_536) -> None:
        self.engine_block = engine_block
        self.router_block = router_block
        self.router_max_blocks = router_max_blocks
        self._memo: OrderedDict[tuple[int, int, int], tuple[list[int], list[int], int]] = OrderedDict()
        self._memo_max = memo

    def _block(self, parents: tuple[int, int], key: int, ids: list[int]) -> tuple[list[int], list[int], int]:
        """One trace block after the chain ending in ``parents`` (engine, router): its engine
        hashes, its router hashes and its router chain's last hash."""
        mk = (parents[0], parents[1], key)
        got = self._memo.get(mk)
        if got is not None:
            self._memo.move_to_end(mk)
            return got
        eng = block_hashes(ids, self.engine_block, parents[0])
        rt: list[int] = []
        prev: int | None = parents[1] or None
        for s in range(0, len(ids) - self.router_block + 1, self.router_block):
            prev = next_id_block_hash(prev, ids[s:s + self.router_block])
            rt.append(prev)
        got = (eng, rt, prev or 0)
        self._memo[mk] = got
        if len(self._memo) > self._memo_max:
            self._memo.popitem(last=False)
        return got

    def of(self, r: TraceRequest, index: int) -> Prompt:
        """Shared blocks (whole multiples of both block sizes) through the memo, the rest hashed here."""
        ids: list[int] = []
        eng: list[int] = []
        rt: list[int] = []
        parents = (0, 0)
        bt = r.block_tokens
        aligned = bt % self.engine_block == 0 and bt % self.router_block == 0
        for k, b in enumerate(r.blocks):
            if (k + 1) * bt > r.input_tokens or not aligned:
                break
            block = block_ids(b, bt)
            e, t, last = self._block(parents, b, block)
            ids += block
            eng += e
            rt += t
            parents = (e[-1] if e else parents[0], last)
        own = r.input_tokens - len(ids)
        if own > 0:
            ids += block_ids(-(index + 1), own)
            eng += block_hashes(ids[len(eng) * self.engine_block:], self.engine_block, eng[-1] if eng else 0)
            full = min(len(ids) // self.router_block, self.router_max_blocks)
            prev: int | None = rt[-1] if rt else None
            for i in range(len(rt), full):
                prev = next_id_block_hash(prev, ids[i * self.router_block:(i + 1) * self.router_block])
                rt.append(prev)
        return Prompt(ids, eng, tuple(rt[:self.router_max_blocks]))
