"""From a review of this stop's own changes (574d650 onwards): each test failed before its fix and
names the problem it showed (pure unit tests: no Ray, no servers)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from prometheus_client.parser import _parse_sample

from narwhal_serve.admission.core import Ask, Placement, decide
from narwhal_serve.config import EngineConfig
from narwhal_serve.engines.metrics import parse_engine_metrics
from narwhal_serve.protocol.requests import parse_request
from narwhal_serve.relay.resume import continuation_body
from tests.unit.admission.test_overload_decisions import NOW, engine, view


# -- (1) the /metrics reader against prometheus_client's parser ------------------------------------

def _prom_running(line: str) -> float:
    """What prometheus_client's own sample parser reads for ``vllm:num_requests_running`` (0: refused)."""
    try:
        s = _parse_sample(line)
    except Exception:  # noqa: BLE001 — the definition: what the parser refuses is not a sample
        return 0.0
    v = float(s.value)
    return v if s.name == "vllm:num_requests_running" and math.isfinite(v) else 0.0


@pytest.mark.parametrize("line", [
    # a name followed by a tab: the new line finder takes it (``(?=[ \t{])``), _sample then looks
    # for a space only and drops the line (prometheus_client splits the name at space or tab)
    "vllm:num_requests_running\t3",
    "vllm:num_requests_running\t3\t1700000000000",
    # extra fields: prometheus_client reads the first as the value (and the last as the timestamp);
    # the reader before 58c4b33 read them too, the new ``len(fields) > 2`` drops the sample
    "vllm:num_requests_running 3 1 1700000000000",
    'vllm:num_requests_running{engine="0"} 3 1 1700000000000',
    # a timestamp that is not a number: prometheus_client refuses the sample, the reader reads 3
    "vllm:num_requests_running 3 abc",
    'vllm:num_requests_running{engine="0"} 3 abc',
    # ``_`` in the value: prometheus_client refuses it (_parse_value), Python's float reads 1_0 = 10
    "vllm:num_requests_running 1_0",
])
def test_metrics_reader_reads_what_prometheus_client_reads(line: str) -> None:
    assert parse_engine_metrics(line).running == _prom_running(line), line


# -- (2) a client's connector parameters on the resume path ---------------------------------------

def test_a_continuation_does_not_carry_the_clients_connector_parameters() -> None:
    """17cc8d4 keeps a client's ``kv_transfer_params`` / ``ec_transfer_params`` (in ``vllm_xargs``,
    and ``ec_transfer_params`` top-level) from every vLLM leg because one such value ends the
    engine core for every user; but a resume's continuation (relay/resume.py continuation_body, sent
    to a vLLM engine) is built from the client's body again and carries them all."""
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "q"}],
            "vllm_xargs": {"kv_transfer_params": "x", "ec_transfer_params": "y", "keep": 1},
            "ec_transfer_params": "z"}
    req = parse_request("chat", json.dumps(body).encode(), model="m")
    out = continuation_body(req, [1, 2, 3], [4])
    assert out is not None
    assert "ec_transfer_params" not in out
    xargs = out.get("vllm_xargs") or {}
    assert "kv_transfer_params" not in xargs and "ec_transfer_params" not in xargs, out


# -- (4) the spare prefill route and the request's fit --------------------------------------------

def _leg(name: str, role: str, inflight: int, context: int) -> Any:
    cfg = EngineConfig(name=name, url=f"http://{name}", role=role, dialect="vllm")
    return engine(name, cfg=cfg, inflight=inflight, context=context)


@pytest.mark.parametrize("predictive", [True, False])
def test_the_spare_prefill_engine_holds_the_prompt(predictive: bool) -> None:
    """_roomy keeps only the routes a prompt fits (a context an exact prompt fills is out), but
    _spare_prefill adds its spare route after that, from the least loaded other prefill engine
    whatever its context: here p2 (1,024 tokens) for a 2,000-token prompt while p3 (8,192) is
    eligible; when p1 fails the request goes to an engine that refuses it as too long."""
    engines = (_leg("p1", "prefill", 0, 8192), _leg("p2", "prefill", 1, 1024), _leg("p3", "prefill", 2, 8192),
               _leg("d1", "decode", 0, 8192))
    v = view(*engines) if predictive else view(*engines).__class__(engines=engines, unavailable=None,
                                                                    predictive=False)
    out = decide(v, Ask(2000, 30.0, exact=True), NOW, 0)
    assert isinstance(out, Placement), out
    contexts = {e.cfg.name: e.context for e in engines}
    assert all(2000 < contexts[n] for r in out.routes for n in r.engines), [r.engines for r in out.routes]


# -- (5) chat rendering fields: what vLLM 0.32 takes (pydantic lax mode) -------------------------

@pytest.mark.parametrize("key,value", [
    ("add_generation_prompt", 1), ("add_generation_prompt", 0), ("add_generation_prompt", "false"),
    ("continue_final_message", "no"), ("continue_final_message", 0),
])
def test_a_lax_boolean_vllm_takes_is_taken(key: str, value: Any) -> None:
    """vLLM 0.32's ChatCompletionRequest types these ``bool`` in pydantic's lax mode: 0/1 and
    "true"/"false"/"yes"/"no"/"on"/"off"/... validate (checked against the installed vLLM 0.32:
    ChatCompletionRequest(add_generation_prompt="false") is False); check_rendering refuses them
    with a 400 (and test_rendering_fields.py lists ``("add_generation_prompt", 1)`` as BAD)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, key: value}
    parse_request("chat", json.dumps(body).encode(), model="m")
