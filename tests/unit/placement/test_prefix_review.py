"""Review of placement (picker, order, prefix) and how admission/core.py ranks with them: each test
shows a bug against docs/contract.md ("Placement", "Admission", "Tokenization") and passes once it
is fixed."""

from __future__ import annotations

from typing import Any

from narwhal_serve.placement.prefix import PrefixIndex, matched_blocks, request_prefix

CHARS, TOKENS, MAX_BLOCKS = 256, 64, 128  # the placement defaults


def _hashes(route: str, body: dict[str, Any]) -> tuple[int, ...]:
    return request_prefix(route, body, None, CHARS, TOKENS, MAX_BLOCKS)[0]


# -- prefix hashing -------------------------------------------------------------------------------

def test_a_text_prompt_cut_by_truncate_prompt_tokens_is_not_hashed_from_its_start() -> None:
    """vLLM keeps the last N tokens of a prompt with ``truncate_prompt_tokens`` N (contract,
    "Tokenization"): its cache then holds none of the uncut prompt's leading blocks, yet the request
    is hashed (matched, credited, and learned into the engine's index) as the whole text."""
    text = "".join(f"word{i} " for i in range(400))  # ~2,900 characters: 11 blocks
    full = _hashes("completion", {"prompt": text})
    cut = _hashes("completion", {"prompt": text, "truncate_prompt_tokens": 5})
    assert full
    assert not set(cut) & set(full), "a prompt the engine cuts to its last 5 tokens is hashed as the uncut one"


def _chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


A, B = "a" * 600, "b" * 600


def test_a_media_part_is_part_of_the_chat_prefix() -> None:
    """A chat's blocks stand for its prompt (prefix.py: "equal hashes mean equal prefixes"); the
    engine's prompt holds the image (vLLM mixes each image's hash into its blocks), the char
    hashing drops it: two chats with different images, or with and without one, get every block
    equal, and the blocks after the image are credited where the engine holds another image's."""
    img = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    one = _hashes("chat", _chat(text(A), img("http://x/1.png"), text(B)))
    two = _hashes("chat", _chat(text(A), img("http://x/2.png"), text(B)))
    none = _hashes("chat", _chat(text(A), text(B)))
    assert len(one) >= 4
    assert one != two, "chats with different images hash alike"
    assert one != none, "a chat with an image hashes as the one without"


def test_tools_and_tool_calls_are_part_of_the_chat_prefix() -> None:
    """The chat template renders ``tools`` and an assistant turn's ``tool_calls`` into the prompt
    before the turns after it; the char hashing reads only roles and text content, so prompts that
    differ there share every block."""
    msgs = [{"role": "user", "content": A + B}]
    f = {"type": "function", "function": {"name": "lookup_weather", "parameters": {"type": "object"}}}
    g = {"type": "function", "function": {"name": "send_an_email", "parameters": {"type": "object"}}}
    assert _hashes("chat", {"messages": msgs, "tools": [f]}) != _hashes("chat", {"messages": msgs, "tools": [g]})

    def convo(args: str) -> dict[str, Any]:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
        return {"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                             {"role": "user", "content": A + B}]}

    assert _hashes("chat", convo('{"city": "Paris"}')) != _hashes("chat", convo('{"city": "Tokyo"}'))


# -- the learned index's eviction -----------------------------------------------------------------

def test_a_prompt_longer_than_the_index_keeps_its_start() -> None:
    """Blocks chain: a prompt matches only from its first block.  The index evicts a prompt's
    *start* first (it is inserted first, so least recent), keeping blocks no prompt can ever match;
    the engine's cache frees a request's tail first (contract: "its first block last, so the
    prompt's start is the most recent", as in the engine's own cache)."""
    idx = PrefixIndex(3)
    idx.learn([1, 2, 3, 4])
    assert matched_blocks(idx.held(), [1, 2, 3, 4]) == 3, list(idx.held())


def test_a_full_index_evicts_the_oldest_prompts_tail_not_its_start() -> None:
    idx = PrefixIndex(4)
    idx.learn([1, 2, 3])
    idx.learn([10, 11])  # one block must go
    assert matched_blocks(idx.held(), [10, 11]) == 2
    assert matched_blocks(idx.held(), [1, 2, 3]) == 2, list(idx.held())  # (now 0: 2 and 3 kept, 1 gone)


def test_the_view_of_the_most_recent_blocks_holds_the_prompts_starts() -> None:
    """Leases decide on ``frozen(prefix_view_blocks)``, the most recent blocks: it carries the
    *tail* of the older prompt (useless: chained) instead of its start."""
    idx = PrefixIndex(100)
    idx.learn([1, 2, 3])
    idx.learn([10, 11])
    assert matched_blocks(idx.frozen(3), [1, 2, 3]) >= 1, sorted(idx.frozen(3))


def test_idle_prefill_engines_take_turns() -> None:
    """"Ties rotate from a place of each lease's own (its id's hash): leases deciding on the same
    view in the same instant would otherwise each put their next request on the same idle engine"
    (contract, "Ranking").  P/D routes rotated over their decode engines only: every lease, at any
    rotation, put its prefill on the first idle prefill engine of the fleet's order."""
    from narwhal_serve.admission.core import Ask, Placement, decide
    from narwhal_serve.config import EngineConfig
    from tests.unit.admission.test_overload_decisions import NOW, engine, view

    def leg(name: str, role: str) -> Any:
        return engine(name, cfg=EngineConfig(name=name, url=f"http://{name}", role=role))

    v = view(leg("p1", "prefill"), leg("p2", "prefill"), leg("d1", "decode"), leg("d2", "decode"))
    firsts = set()
    for rotation in range(16):
        out = decide(v, Ask(100, 30.0), NOW, rotation)
        assert isinstance(out, Placement), out
        firsts.add(out.first_engine)
    assert firsts == {"p1", "p2"}, firsts


def test_the_prefill_engine_holding_the_prefix_is_preferred() -> None:
    """"Ranking ... within both targets first; among those, the route whose first-token engine
    holds the longest prefix of the prompt" (contract, "Admission").  A unified holder wins (u2
    below); a P/D prefill holder busier than another prefill engine by one request never did: P/D
    routes existed only over the least loaded prefill engine, so the whole prefix was prefilled
    again on a cold engine."""
    from narwhal_serve.admission.core import Ask, Placement, decide
    from narwhal_serve.config import EngineConfig
    from tests.unit.admission.test_overload_decisions import NOW, engine, view

    def leg(name: str, role: str, **kw: Any) -> Any:
        return engine(name, cfg=EngineConfig(name=name, url=f"http://{name}", role=role), **kw)

    def placed(v: Any, ask: Ask) -> Placement:
        out = decide(v, ask, NOW, 0)
        assert isinstance(out, Placement), out
        return out

    prefix = (11, 22, 33, 44)
    ask = Ask(1000, 30.0, prefix=prefix, prefix_block_tokens=64.0)
    unified = placed(view(leg("u1", "unified"), leg("u2", "unified", inflight=1, prefix=frozenset(prefix))), ask)
    assert unified.first_engine == "u2" and unified.cached_tokens > 0  # (the rule, on unified engines)
    pd = placed(view(leg("p1", "prefill"), leg("p2", "prefill", inflight=1, prefix=frozenset(prefix)),
                     leg("d1", "decode"), leg("d2", "decode")), ask)
    assert pd.first_engine == "p2" and pd.cached_tokens > 0, pd
