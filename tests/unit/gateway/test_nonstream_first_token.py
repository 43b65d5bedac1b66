"""(Found by a hostile probe.) A non-streaming answer's first token frees its prefill permit and moves
it to decoding in the ledger, as a stream's does: the assembled path never announced it (the meter
saw the first token while the batch was read, before the check), so a non-streaming request held a
prefill permit, and counted as prefilling at its engine, until its whole answer was written."""

from __future__ import annotations

import asyncio

import httpx

from tests.support.local_router import start_local_router


async def _gauges_while_answering(stream: bool) -> tuple[dict[str, int], int]:
    r = await start_local_router({
        "admission": {"mode": "open"},
        "sim": {"engines": [{"name": "u1", "role": "unified", "tpot_base_s": 0.05, "eos_prob": 0}]},
    })
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": "narwhal-sim", "prompt": "word " * 10, "max_tokens": 60, "stream": stream}
            answer = asyncio.create_task(c.post(r.url + "/v1/completions", json=body))
            seen: dict[str, int] = {}
            for _ in range(400):  # (bounded: until the engine decodes, then until its first token is heard)
                await asyncio.sleep(0.01)
                g = r.svc.snapshot()["gauges"]
                decoding = r.svc.engines["u1"].pending_prefill_requests == 0 and r.svc.engines["u1"].inflight == 1
                if g["decode_inflight"] == 1 and decoding and g["prefill_inflight"] == 0:
                    seen = dict(g)
                    break
            assert not answer.done(), "the answer ended before its first token was heard"
            assert (await answer).status_code == 200
            pending = r.svc.engines["u1"].pending_prefill_requests
        return seen, pending
    finally:
        await r.stop()


async def test_a_non_streaming_answers_first_token_frees_its_prefill_permit() -> None:
    for stream in (True, False):
        seen, pending = await _gauges_while_answering(stream)
        assert seen, f"stream={stream}: the prefill permit was held (or the engine counted it prefilling) while it decoded"
        assert pending == 0
