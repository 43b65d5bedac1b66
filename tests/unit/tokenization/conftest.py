"""The e2e model's tokenizer, built once per module that asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal_serve.tokenization.hf import HfTokenizer
from tests.support.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> HfTokenizer:
    return HfTokenizer(tok_dir)
