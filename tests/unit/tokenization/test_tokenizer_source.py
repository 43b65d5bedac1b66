"""Where the router's tokenizer comes from (tokenization/sizer.py ``tokenizer_path``): a managed
engine's model directory, unless the engine is started with flags that make it render or tokenize
prompts otherwise (its own chat template, another tokenizer): the router's count would not be the
engine's, and an exact count decides refusals (the context row), so it sizes with the estimate."""

from __future__ import annotations

from pathlib import Path

from narwhal_serve.config import NarwhalConfig
from narwhal_serve.tokenization.sizer import renders_otherwise, tokenizer_path


def config(model: Path, *args: str, tokenizer: str | None = None) -> NarwhalConfig:
    return NarwhalConfig.model_validate({
        **({"tokenizer": tokenizer} if tokenizer else {}),
        "engines": [{"name": "e", "launch": {"kind": "vllm", "model": str(model), "args": list(args)}}]})


def test_a_managed_engine_rendering_otherwise_leaves_the_router_on_the_estimate(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_path(config(tmp_path)) == str(tmp_path)
    assert tokenizer_path(config(tmp_path, "--max-model-len", "512", "--enforce-eager")) == str(tmp_path)
    for args in (("--chat-template", "/t/chat.jinja"), ("--tokenizer=/other",),
                 ("--default-chat-template-kwargs", '{"enable_thinking": false}'), ("--tokenizer-mode", "mistral"),
                 ("--exclude-tools-when-tool-choice-none",)):
        assert tokenizer_path(config(tmp_path, *args)) is None, args
        assert renders_otherwise(args) == args[0].split("=")[0]
    # the operator's explicit tokenizer still wins
    assert tokenizer_path(config(tmp_path, "--chat-template", "x", tokenizer="/mine")) == "/mine"
