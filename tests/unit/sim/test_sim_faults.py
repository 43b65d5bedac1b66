"""Every injectable fault, per request (``sim.fault``) and engine-wide (config / ``/sim/control``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sim_testutil import CHAT, COMPLETIONS, chat_body, completion_body, content_chunks, parse_sse, sim_client

from narwhal_serve.config.sim import SimEngineConfig
from narwhal_serve.sim.server import SimServer, start_server


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    srv = await start_server(SimEngineConfig(tpot_base_s=0.001), "127.0.0.1", 0)
    try:
        yield srv
    finally:
        await srv.stop()


def _body(fault: str, after: int | None = None, **extra: Any) -> dict[str, Any]:
    sim: dict[str, Any] = {"fault": fault}
    if after is not None:
        sim["fault_after"] = after
    return chat_body(model=None, sim=sim, **extra)


async def _read_events(resp: httpx.Response, into: list[Any]) -> None:
    buf = ""
    async for text in resp.aiter_text():
        buf += text
        while "\n\n" in buf:
            block, buf = buf.split("\n\n", 1)
            into.extend(parse_sse(block + "\n\n"))


async def test_error_500() -> None:
    async with sim_client() as c:
        r = await c.post(CHAT, json=_body("error_500", stream=True))
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError" and r.json()["error"]["code"] == 500


async def test_hang_until_client_disconnects(server: SimServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(5.0, read=0.3)) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(CHAT, json=_body("hang"), headers={"X-Request-Id": "hung-1"})
        ok = await c.post(CHAT, json=chat_body(model=None, max_tokens=2))
        stats = (await c.get("/sim/stats")).json()
    assert ok.status_code == 200
    assert stats["requests"][0]["request_id"] == "hung-1" and stats["running"] == 0


async def test_hang_mid_stream(server: SimServer) -> None:
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(5.0, read=0.3)) as c:
        async with c.stream("POST", CHAT, json=_body("hang_mid_stream", 3, stream=True)) as resp:
            assert resp.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                await _read_events(resp, events)
    assert len(events) == 3 and "[DONE]" not in events


async def test_reset_mid_stream(server: SimServer) -> None:
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as c:
        async with c.stream("POST", CHAT, json=_body("reset_mid_stream", stream=True)) as resp:
            assert resp.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                await _read_events(resp, events)
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(CHAT, json=_body("reset_mid_stream"))
        assert (await c.get("/health")).status_code == 200
    assert len(events) == 2 and "[DONE]" not in events


async def test_stale_metrics(server: SimServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(5.0, read=0.3)) as c:
        await c.post("/sim/control", json={"faults": ["stale_metrics"]})
        with pytest.raises(httpx.ReadTimeout):
            await c.get("/metrics")
        assert (await c.get("/health")).status_code == 200
        await c.post("/sim/control", json={"faults": []})
        assert "vllm:num_requests_running" in (await c.get("/metrics")).text


async def test_malformed_sse() -> None:
    async with sim_client() as c:
        text = (await c.post(CHAT, json=_body("malformed_sse", stream=True))).text
        ns = await c.post(CHAT, json=_body("malformed_sse"))
    events = parse_sse(text)
    assert events[2] == "{not json" and events[-1] == "[DONE]"
    assert sum(isinstance(e, str) for e in events) == 2
    with pytest.raises(ValueError):
        ns.json()


@pytest.mark.parametrize(("fault", "expected"), [("bad_token_ids", [True]), ("negative_token_ids", [-1])])
async def test_bad_token_ids(fault: str, expected: list[Any]) -> None:
    async with sim_client() as c:
        events = parse_sse((await c.post(CHAT, json=_body(fault, 1, stream=True, return_token_ids=True))).text)
        ns = (await c.post(CHAT, json=_body(fault, 1, return_token_ids=True))).json()
        comp = parse_sse((await c.post(COMPLETIONS, json=completion_body(
            model=None, stream=True, return_token_ids=True, sim={"fault": fault, "fault_after": 0}))).text)
    ids = [ev["choices"][0]["token_ids"] for ev in content_chunks(events)]
    assert ids[1] == expected and all(len(i) == 1 and i != expected for n, i in enumerate(ids) if n != 1)
    assert ns["choices"][0]["token_ids"][1] == expected[0]
    assert comp[0]["choices"][0]["token_ids"] == expected


async def test_missing_token_ids() -> None:
    async with sim_client() as c:
        events = parse_sse((await c.post(CHAT, json=_body("missing_token_ids", stream=True,
                                                            return_token_ids=True))).text)
        ns = (await c.post(CHAT, json=_body("missing_token_ids", return_token_ids=True))).json()
    assert events[0]["prompt_token_ids"]
    assert all("token_ids" not in ev["choices"][0] for ev in content_chunks(events))
    assert "token_ids" not in ns["choices"][0]


async def test_missing_usage() -> None:
    async with sim_client() as c:
        body = _body("missing_usage", stream=True, stream_options={"include_usage": True})
        events = parse_sse((await c.post(CHAT, json=body)).text)
        ns = (await c.post(CHAT, json=_body("missing_usage"))).json()
    assert all(ev["choices"] for ev in events[:-1]) and events[-1] == "[DONE]"
    assert ns["usage"] is None


async def test_unhealthy_engine_wide() -> None:
    async with sim_client(faults=["unhealthy"]) as c:
        assert (await c.get("/health")).status_code == 503


async def test_unsupported_field() -> None:
    async with sim_client() as c:
        events = parse_sse((await c.post(CHAT, json=_body("unsupported_field", stream=True))).text)
    with_audio = [ev for ev in content_chunks(events) if "audio" in ev["choices"][0]["delta"]]
    assert len(with_audio) == 1 and with_audio[0]["choices"][0]["delta"]["audio"] == {"id": "x"}


async def test_tool_call_no_id() -> None:
    async with sim_client() as c:
        body = _body("tool_call_no_id", stream=True)
        body["sim"]["script"] = "tool_calls"
        events = parse_sse((await c.post(CHAT, json=body)).text)
    calls = [ev["choices"][0]["delta"]["tool_calls"][0] for ev in content_chunks(events)]
    firsts = [call for call in calls if "type" in call]
    assert len(firsts) == 2 and all("id" not in call for call in firsts)
    assert firsts[0]["function"]["name"] == "get_weather"


async def test_engine_wide_fault_via_control() -> None:
    async with sim_client() as c:
        await c.post("/sim/control", json={"faults": ["error_500"]})
        assert (await c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})).status_code == 500
        await c.post("/sim/control", json={"faults": []})
        assert (await c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})).status_code == 200


@pytest.mark.parametrize(("fault", "status", "type_"), [("error_429", 429, "RateLimitError"),
                                                        ("error_503", 503, "ServiceUnavailableError")])
async def test_busy_answers_carry_the_envelope_and_retry_after(fault: str, status: int, type_: str) -> None:
    async with sim_client() as c:
        streamed = await c.post(CHAT, json=_body(fault, stream=True))
        await c.post("/sim/control", json={"faults": [fault], "retry_after_s": 3})
        engine_wide = await c.post(COMPLETIONS, json=completion_body(model=None))
        await c.post("/sim/control", json={"faults": []})
        ok = await c.post(CHAT, json=chat_body(model=None))
    assert streamed.headers["retry-after"] == "1" and engine_wide.headers["retry-after"] == "3"
    for r in (streamed, engine_wide):
        assert r.status_code == status
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == (type_, status, None) and fault in err["message"]
    assert ok.status_code == 200
