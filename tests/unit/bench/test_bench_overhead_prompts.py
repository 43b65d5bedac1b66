"""``narwhal-bench overhead``'s prompt pool: every phase goes on through it where the last one
stopped (with ``--distinct-prompts N`` no prompt is sent twice before N were), and
``--unique-tail`` gives every request a text of its own."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal_serve.bench import overhead
from narwhal_serve.bench.overhead import OverheadArgs, OverheadRun
from narwhal_serve.bench.workload import RequestSpec


class FakeFleet:
    endpoints: dict[str, Any] = {"a": object(), "b": object()}

    def settle(self) -> None:
        pass


@pytest.mark.parametrize("unique_tail", [False, True])
async def test_phases_go_on_through_the_pool(monkeypatch: pytest.MonkeyPatch, unique_tail: bool) -> None:
    sent: list[str] = []

    async def closed_loop(session: Any, ep: Any, shape: Any, specs: list[RequestSpec], **kw: Any) -> list[Any]:
        taken = specs[:7]  # a phase sends as many as its time allows: here 7
        sent.extend(s.prompt for s in taken)
        return list(taken)

    monkeypatch.setattr(overhead, "run_closed_loop", closed_loop)
    run = OverheadRun(OverheadArgs(prompt_tokens=300, distinct_prompts=20, unique_tail=unique_tail),
                      FakeFleet(), ["a", "b"])  # type: ignore[arg-type]
    for target in ("a", "b", "a"):
        await run.closed(target, "latency", 1, 1.0, True, 4)
    assert len(sent) == 21
    # three phases, two targets: no prompt twice before the pool's 20 were sent (before, each phase
    # began the pool again: 7 prompts, three times)
    assert len(set(sent)) == (21 if unique_tail else 20)
    if not unique_tail:
        assert sent[20] == sent[0]  # the 21st wraps around the pool of 20
        assert len({p[:200] for p in sent[:20]}) == 20
    else:
        assert all(p.endswith(f" {i}") for i, p in enumerate(sent[:7]))
