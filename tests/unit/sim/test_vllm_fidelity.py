"""Review: places where the simulator still answers differently from vLLM 0.32's OpenAI server.

Each test states vLLM's behaviour (file:line under ``vllm/``, the 0.32 package in
``.cache/vllm-venv``) and fails while the simulator diverges from it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sim_testutil import CHAT, COMPLETIONS, chat_body, completion_body, content_chunks, parse_sse, sim_client

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.kvevents.wire import BlockStored, Event
from narwhal_serve.sim.app import create_app, get_engine
from narwhal_serve.sim.kvevents import KVEventSink
from narwhal_serve.sim.textgen import token_str

TINY = {"model": "tiny", "max_model_len": 512}


# ---- 1. stream_options.continuous_usage_stats ------------------------------------------------------
# vLLM: entrypoints/serve/utils/api_utils.py:289-301 (should_include_usage reads continuous_usage_stats);
# chat_completion/serving.py:576-586 (role chunk: usage with completion_tokens 0) and :814-825 (every
# content chunk: cumulative usage); completion/serving.py:433-440 (every chunk).  The router asks for it
# on continuations (relay/resume.py:150) and passes a client's through.


async def test_chat_continuous_usage_stats_on_every_chunk() -> None:
    so = {"include_usage": True, "continuous_usage_stats": True}
    async with sim_client(**TINY) as c:
        r = await c.post(CHAT, json=chat_body(stream=True, stream_options=so, return_token_ids=True))
    events = parse_sse(r.text)
    p = len(events[0]["prompt_token_ids"])
    assert events[0].get("usage") is not None, "role chunk carries no usage"
    assert events[0]["usage"]["completion_tokens"] == 0 and events[0]["usage"]["prompt_tokens"] == p
    done = 0
    for ev in content_chunks(events):
        done += len(ev["choices"][0]["token_ids"])
        u = ev.get("usage")
        assert u is not None, "content chunk carries no usage"
        assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (p, done, p + done)


async def test_completion_continuous_usage_stats_on_every_chunk() -> None:
    so = {"include_usage": True, "continuous_usage_stats": True}
    async with sim_client(**TINY) as c:
        r = await c.post(COMPLETIONS, json=completion_body(stream=True, stream_options=so, return_token_ids=True))
    events = parse_sse(r.text)
    p = len(events[0]["choices"][0]["prompt_token_ids"])
    done = 0
    for ev in content_chunks(events):
        done += len(ev["choices"][0]["token_ids"])
        assert ev.get("usage") == {"prompt_tokens": p, "total_tokens": p + done, "completion_tokens": done}


# ---- 2. stop strings: streamed text held back ------------------------------------------------------
# vLLM: v1/engine/detokenizer.py:87-90 (stop_buffer_length = longest stop - 1 when the stop string is
# excluded) and :161-175 (get_next_output_text sends all but that many characters until the request
# finishes); completion/serving.py:394-396 notes the text lagging the tokens.


async def test_stream_text_held_back_while_a_stop_string_may_begin() -> None:
    stop = "@" * 10  # in no token: never matches, holds back 9 characters
    async with sim_client(**TINY) as c:
        r = await c.post(CHAT, json=chat_body(stream=True, stop=[stop], max_tokens=6, return_token_ids=True))
    chunks = content_chunks(parse_sse(r.text))
    full, sent = "", ""
    for ch in (ev["choices"][0] for ev in chunks):
        full += "".join(token_str(i) for i in ch["token_ids"])
        sent += ch["delta"].get("content") or ""
        expected = full if ch["finish_reason"] is not None else full[: max(0, len(full) - (len(stop) - 1))]
        assert sent == expected


# ---- 3. min_tokens and stop strings: off by one -----------------------------------------------------
# vLLM: v1/engine/detokenizer.py:134-137 checks stop strings only once num_output_tokens() > min_tokens,
# and then only in the text after the first min_tokens tokens.


async def test_stop_string_not_matched_within_the_first_min_tokens_tokens() -> None:
    async with sim_client(**TINY) as c:
        first = (await c.post(CHAT, json=chat_body(max_tokens=1, seed=3))).json()["choices"][0]["message"]["content"]
        stop = first[-1]
        r = (await c.post(CHAT, json=chat_body(max_tokens=6, seed=3, stop=[stop], min_tokens=1,
                                               return_token_ids=True))).json()
    ch = r["choices"][0]
    # the first (min_tokens-th) token's text is never searched: it is all there
    assert ch["message"]["content"].startswith(first), (first, ch)
    assert len(ch["token_ids"]) >= 2


# ---- 4. several stop strings in one token: the earliest *ending* wins ------------------------------
# vLLM: v1/engine/detokenizer.py:321-366 (check_stop_strings: "the stop string that completes earliest
# in the text is selected"; ties by list order).  The simulator picks the earliest *starting* one.


async def test_stop_string_that_completes_first_wins() -> None:
    async with sim_client(**TINY) as c:
        for seed in range(200):
            t = (await c.post(CHAT, json=chat_body(max_tokens=1, seed=seed))).json()["choices"][0]["message"]["content"]
            if len(t) >= 3 and t[1] != t[0]:
                break
        else:
            raise AssertionError("no first token of 3+ characters found")
        r = (await c.post(CHAT, json=chat_body(max_tokens=4, seed=seed, stop=[t, t[1]]))).json()
    ch = r["choices"][0]
    assert (ch["stop_reason"], ch["message"]["content"]) == (t[1], t[:1])


# ---- 5. KV events: blocks filled by generated tokens are cached and announced ----------------------
# vLLM: v1/core/kv_cache_manager.py:612-616 caches up to min(computed + new, request.num_tokens) tokens
# at every step (output tokens included); block_pool.py:346-374 announces them as BlockStored with
# request.all_token_ids.  Every computed token (all but the last sampled one) is in a full block or the
# partial tail.


class _Recorder(KVEventSink):
    def __init__(self) -> None:
        self.events: list[Event] = []

    def publish(self, events: Any) -> None:
        self.events.extend(events)


async def test_kv_events_announce_blocks_filled_during_decode() -> None:
    import httpx

    app = create_app(SimEngineConfig(model="tiny", max_model_len=512, kv_block_size=4))
    sink = _Recorder()
    get_engine(app).kv_events = sink
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks of 4
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as c:
        r = (await c.post(COMPLETIONS, json=completion_body(prompt=prompt, max_tokens=12, return_token_ids=True))).json()
    out = r["choices"][0]["token_ids"]
    computed = (prompt + out)[: len(prompt) + len(out) - 1]  # the last sampled token's KV is never computed
    stored = [t for ev in sink.events if isinstance(ev, BlockStored) for t in ev.token_ids]
    assert stored == computed[: len(computed) // 4 * 4]


# ---- 6. a non-streaming request is aborted when its client goes away -------------------------------
# vLLM: chat_completion/api_router.py:52 and completion/api_router.py:45 wrap the handlers in
# serve/utils/api_utils.py:51-91 with_cancellation: an http.disconnect cancels the handler, which aborts
# the request (its slot freed).  The router sends P/D prefill legs non-streaming (engines/vllm.py:64-71).


async def test_nonstream_request_freed_on_client_disconnect() -> None:
    app = create_app(SimEngineConfig(model="tiny", max_model_len=512, tpot_base_s=0.2, tpot_per_running_s=0.0))
    engine = get_engine(app)
    body = json.dumps(chat_body(max_tokens=50)).encode()
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    inbox.put_nowait({"type": "http.request", "body": body, "more_body": False})
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"host", b"sim"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1234), "server": ("sim", 80)}

    async def send(_: dict[str, Any]) -> None:
        pass

    task = asyncio.create_task(app(scope, inbox.get, send))
    try:
        for _ in range(200):
            if engine.scheduler.running:
                break
            await asyncio.sleep(0.01)
        assert engine.scheduler.running == 1
        inbox.put_nowait({"type": "http.disconnect"})
        for _ in range(100):  # a second: vLLM aborts at once
            if not engine.scheduler.running:
                break
            await asyncio.sleep(0.01)
        assert engine.scheduler.running == 0, "the disconnected request still holds its slot"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# ---- 7. finish_reason "length" only at max_tokens or the context -----------------------------------
# vLLM: v1/core/sched/utils.py:114-118 ends a request with "length" only at max_tokens or max_model_len;
# with max_tokens unset, max_tokens is the room left in the context (entrypoints/serve/utils/
# api_utils.py:169-205).  The simulator's default_max_tokens cap (its "model that stops by itself",
# handlers.py:559-569) ends with "length" well short of both.


async def test_unbounded_chat_does_not_end_with_length_short_of_the_context() -> None:
    async with sim_client(**TINY, default_max_tokens=5, eos_prob=0.0) as c:
        r = (await c.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})).json()
    ch, u = r["choices"][0], r["usage"]
    assert ch["finish_reason"] != "length" or u["total_tokens"] == 512, (ch["finish_reason"], u)
