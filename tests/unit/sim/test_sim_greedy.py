"""The simulator's greedy decoding is a function of the context alone, as a model's is: a
continuation whose prompt is the prompt plus the first k output tokens generates exactly the rest
(what a token-exact resume relies on, docs/contract.md, "Engine failures")."""

from __future__ import annotations

from narwhal_serve.sim.textgen import generate, request_rng_seed


def ids(prompt: list[int], n: int, seed: int = 0) -> list[int]:
    gen = generate(request_rng_seed(seed, None, prompt), max_tokens=n, context=prompt, ignore_eos=True)
    return [t.token_id for t in gen.tokens]


def test_a_greedy_continuation_generates_exactly_the_rest() -> None:
    prompt = [0, 3, 17, 99, 5]
    whole = ids(prompt, 20)
    for k in (1, 7, 19):
        assert ids(prompt + whole[:k], 20 - k) == whole[k:]


def test_greedy_does_not_depend_on_the_engine_seed_but_sampling_does() -> None:
    prompt = [0, 3, 17]
    assert ids(prompt, 10, seed=1) == ids(prompt, 10, seed=2)
    sampled = [generate(request_rng_seed(s, None, prompt), max_tokens=10, ignore_eos=True) for s in (1, 2)]
    assert [t.token_id for t in sampled[0].tokens] != [t.token_id for t in sampled[1].tokens]


def test_include_stop_keeps_the_stop_string_in_the_text() -> None:
    prompt = [0, 9]
    text = "".join(t.text for t in generate(1, max_tokens=30, context=prompt, ignore_eos=True).tokens)
    stop = text[5:8]
    cut = generate(1, max_tokens=30, context=prompt, ignore_eos=True, stop=[stop])
    kept = generate(1, max_tokens=30, context=prompt, ignore_eos=True, stop=[stop], include_stop=True)
    assert kept.text == cut.text + stop and kept.stop_reason == stop == cut.stop_reason
