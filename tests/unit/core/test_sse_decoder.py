from hypothesis import given
from hypothesis import strategies as st

from narwhal_serve.engines.sse import SSEDecoder

STREAM = b'data: {"a":1}\n\n: comment\n\ndata: {"b":2}\r\n\r\nevent: x\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n'
EXPECTED = [b'{"a":1}', b'{"b":2}', b"line1\nline2", b"[DONE]"]


def test_whole_stream() -> None:
    assert SSEDecoder().feed(STREAM) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    dec = SSEDecoder()
    out: list[bytes] = []
    prev = 0
    for c in sorted(cuts) + [len(STREAM)]:
        out += dec.feed(STREAM[prev:c])
        prev = c
    out += dec.flush()
    assert out == EXPECTED


def test_unterminated_event_flushes() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: {}") == []
    assert dec.flush() == [b"{}"]
