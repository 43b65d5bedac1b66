"""Long pieces cut into cached blocks (narwhal_serve/tokenization/segments.py): exact to the whole
text's encoding, the same blocks for the same start, a shared start tokenized once, the cut turned
off for a tokenizer whose words may span a space, and the cache's batch lookup."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest

from narwhal_serve.tokenization.cache import TokenCache
from narwhal_serve.tokenization.hf import HfTokenizer
from narwhal_serve.tokenization.segments import CHUNK_CHARS, segmenter
from tests.support.prompts import exactness_requests
from tests.support.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer")))


def whole(tok: HfTokenizer, text: str, special: bool) -> list[int]:
    return list(tok._rust.encode(text, add_special_tokens=special).ids)


def words(rng: random.Random, n: int) -> str:
    pool = ["the", "router's", "don't", "A", "b", "x1", "東京", "def f(x):", "\n", "  ", "'ll", "Zebra", "é", "ok,"]
    out = []
    for _ in range(n):
        w = rng.choice(pool) if rng.random() < 0.5 else "".join(rng.choice(string.ascii_letters) for _ in range(3))
        out.append(w)
    return " ".join(out)


def test_long_pieces_are_cut_and_exact(tok: HfTokenizer) -> None:
    assert tok.segments is not None and tok.segments.chunk_chars == CHUNK_CHARS  # the self-check agreed
    rng = random.Random(5)
    texts = [words(rng, n) for n in (700, 1500, 4000)]
    texts += [(tok.render_chat(b) if r == "chat" else b["prompt"]) * 12 for r, b in exactness_requests(40, "m", seed=3)]
    cut = 0
    for text in texts:
        for special in (False, True):
            assert tok.encode(text, special) == whole(tok, text, special)
        cut += len(tok.segments.blocks(text)) > 1
    assert cut >= 20  # most of them were long enough to be cut


def test_blocks_end_before_a_space_between_letters_and_depend_only_on_the_start(tok: HfTokenizer) -> None:
    assert tok.segments is not None
    rng = random.Random(9)
    start = words(rng, 3000)
    a, b = tok.segments.blocks(start + " first ending"), tok.segments.blocks(start + "\nanother one entirely " * 50)
    assert "".join(a) == start + " first ending" and len(a) > 5
    assert all(len(x) >= CHUNK_CHARS for x in a[:-1])
    for x, y in zip(a[:-1], a[1:]):
        assert x[-1].isascii() and x[-1].isalpha() and y[0] == " " and y[1].isascii() and y[1].isalpha()
    assert a[:-2] == b[: len(a) - 2]  # the blocks of the shared start are the same blocks
    cjk = "東京のデータ。数据中心。" * 400
    assert tok.segments.blocks(cjk) == [cjk]  # no place to cut: one block


def test_a_shared_start_is_tokenized_once(tok: HfTokenizer) -> None:
    assert tok.segments is not None
    rng = random.Random(11)
    doc = words(rng, 20000)  # ~100 KiB, as a completion prompt
    first = tok.encode(doc + " question one?", True)
    hits, misses = tok.segments.hits, tok.segments.misses
    second = tok.encode(doc + " question two, longer than the first?", True)
    assert second == whole(tok, doc + " question two, longer than the first?", True)
    n = len(tok.segments.blocks(doc + " question two, longer than the first?"))
    assert tok.segments.hits - hits >= n - 2 and tok.segments.misses - misses <= 2  # only the end is new
    assert first[:1000] == second[:1000]


def test_a_pre_tokenizer_that_joins_words_across_a_space_gets_no_cut() -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    corpus = ["ab cd ab cd ef gh", "ab cd", "ef gh ab cd"] * 50
    joined = Tokenizer(models.BPE())
    # a word is two letter runs with the space between them: "ab cd" is one word, merged whole
    joined.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[a-z]+ [a-z]+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    joined.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    samples = ["ab cd ef gh <s>ab cd"]
    seg = segmenter(joined, samples)
    assert seg is not None and seg.chunk_chars == 0  # pieces are exact, cutting at spaces is not
    assert seg.encode("ab cd " * 600, False) == list(joined.encode("ab cd " * 600, add_special_tokens=False).ids)


def test_a_tokenizer_whose_words_span_spaces_gets_no_cut(tok: HfTokenizer) -> None:
    """Found by a fuzzing review: a SuperBPE-like tokenizer ("superword" merges across a space, a
    byte-level pre-tokenizer without its regex) passed the samples' self-check, and "go to the"
    encoded whole is ["go", "Ġto" + "Ġthe"], cut ["go", "Ġto", "Ġthe"]."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from narwhal_serve.tokenization.segments import _splits_between_words

    base = Tokenizer.from_str(tok._rust.to_str())
    assert _splits_between_words(base)
    corpus = ["we went to the shop and to the park", "go to the end of the road"] * 200
    words = Tokenizer(models.BPE())
    words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = json.loads(words.to_str())
    assert "Ġto" in cfg["model"]["vocab"] and "Ġthe" in cfg["model"]["vocab"]
    cfg["model"]["vocab"]["ĠtoĠthe"] = len(cfg["model"]["vocab"])
    cfg["model"]["merges"].append(["Ġto", "Ġthe"])
    cfg["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    superword = Tokenizer.from_str(json.dumps(cfg))
    text = "go to the end " * 300
    whole_ids = list(superword.encode(text, add_special_tokens=False).ids)
    assert cfg["model"]["vocab"]["ĠtoĠthe"] in whole_ids  # a token that spans a space
    assert not _splits_between_words(superword)
    seg = segmenter(superword, ["hello world <s> and more words here"])
    assert seg is not None and seg.chunk_chars == 0  # pieces between special tokens: still cached
    assert seg.encode(text, False) == whole_ids


def test_a_truncation_or_padding_in_tokenizer_json_does_not_apply(tmp_path: Path) -> None:
    """Found by a fuzzing review: a ``tokenizer.json`` with ``truncation`` set cut the router's
    whole-text encodings (transformers' own calls, vLLM's, clear it first)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    src = build_tiny_tokenizer(tmp_path / "src")
    dst = tmp_path / "truncating"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer.json").read_text())
    cfg["truncation"] = {"direction": "Right", "max_length": 16, "strategy": "LongestFirst", "stride": 0}
    cfg["padding"] = {"strategy": {"Fixed": 4096}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                      "pad_type_id": 0, "pad_token": "<unk>"}
    (dst / "tokenizer.json").write_text(json.dumps(cfg))
    text = "short text of a few words, more than sixteen tokens for certain: " * 3
    want = AutoTokenizer.from_pretrained(str(dst), local_files_only=True)(text)["input_ids"]
    assert len(want) > 16
    tok = HfTokenizer(dst)
    assert tok.encode(text, True) == want and tok.prompt("completion", {"prompt": text}).ids == want


def test_a_special_token_matched_on_normalized_text_without_a_normalizer_keeps_the_cache() -> None:
    """GPT-2's ``<|endoftext|>`` is ``normalized: true``; with no normalizer that is matching as
    written, so the segment cache (and its blocks) stays on, exact."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    gpt2.train_from_iterator(["the quick brown fox, it's here: 12 foxes\n"] * 100 + ["東京 data"] * 20,
                             trainers.BpeTrainer(vocab_size=400,
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    gpt2.add_special_tokens([AddedToken("<|endoftext|>", normalized=True)])
    samples = ["the quick<|endoftext|>brown fox", " <|endoftext|> it's 12 foxes\n" * 30]
    seg = segmenter(gpt2, samples)
    assert seg is not None and seg.chunk_chars == CHUNK_CHARS
    rng = random.Random(2)
    for _ in range(20):
        text = "<|endoftext|>".join(words(rng, rng.randrange(50, 900)) for _ in range(rng.randrange(1, 4)))
        assert seg.encode(text, False) == list(gpt2.encode(text, add_special_tokens=False).ids)


def test_token_cache_many_encodes_only_what_it_lacks_in_one_call() -> None:
    calls: list[list[str]] = []

    def many(texts: list[str]) -> list[list[int]]:
        calls.append(list(texts))
        return [[len(t), ord(t[0])] for t in texts]

    cache = TokenCache(lambda t: [len(t), ord(t[0])], min_chars=4, capacity_tokens=5)
    assert cache.many(["aaaa", "bbbbb", "cc"], many) == [[4, 97], [5, 98], [2, 99]]
    assert calls == [["aaaa", "bbbbb", "cc"]] and (cache.hits, cache.misses) == (0, 2)  # "cc": too short to keep
    assert cache.many(["cc", "aaaa", "dddddd", "bbbbb"], many) == [[2, 99], [4, 97], [6, 100], [5, 98]]
    assert calls[1] == ["cc", "dddddd"] and (cache.hits, cache.misses) == (2, 3)
    assert cache("aaaa") == [4, 97] and cache.hits == 2  # 5 tokens held at most: the oldest, "aaaa", went
    assert cache("dddddd") == [6, 100] and cache.hits == 3
