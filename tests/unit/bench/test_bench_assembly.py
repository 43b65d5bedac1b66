from narwhal_serve.assembly.fold import Assembler
from narwhal_serve.bench.assembly import measure, stream


def test_synthetic_stream_is_a_valid_vllm_stream() -> None:
    asm = Assembler("chat", return_token_ids=True)
    for c in stream(50):
        asm.feed(c)
    res = asm.result()
    assert res["choices"][0]["message"]["content"] == "ab" * 50
    assert len(res["choices"][0]["token_ids"]) == 50 and res["usage"]["completion_tokens"] == 50


def test_measure_reports_positive_costs() -> None:
    res = measure(tokens=200, repeats=1)
    assert res["fold_us_per_token"] > 0 and res["relay_us_per_token"] > 0
