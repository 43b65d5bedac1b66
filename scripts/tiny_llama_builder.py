"""Write a tiny random-weight Llama with an offline-trained byte-level BPE tokenizer.

Runs with the *vLLM* venv's python (needs torch, transformers, tokenizers); started by
``scripts/vllm_cpu_engine.py build-model``.  Nothing is downloaded: the tokenizer is trained on text
generated here from a fixed seed, and the weights come from ``torch.manual_seed``.

    python tiny_llama_builder.py OUT_DIR SPEC_JSON

Everything is deterministic for a given SPEC (seed, sizes), so two builds give the same model.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

SPECIALS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# A template in the shape of real models' (tools listed as JSON in a system block, assistant tool calls
# as JSON, a tool role), so the router's chat rendering is checked against vLLM on more than plain
# turns (tests/e2e/test_vllm_tokenization.py).  Newlines stand before block tags, never right after
# one (transformers renders with trim_blocks).
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the quick brown fox jumps over lazy dog hello world who are you what is this router engine token "
    "stream prefill decode cache block model request response latency narwhal whale ocean ice north "
    "sea swim deep blue one two three four five six seven eight nine ten and or not if then else for "
    "while return yield print value list dict string number error warning info debug test check"
).split()
_SYLLABLES = "ba be bi bo bu ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re ri ro ru sa se si so su ta te ti to tu".split()


def corpus(seed: int, lines: int) -> list[str]:
    """Deterministic pseudo-text: English-ish words, made-up words, numbers, punctuation, code."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 18)):
            r = rng.random()
            if r < 0.55:
                w = rng.choice(_WORDS)
            elif r < 0.85:
                w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            elif r < 0.95:
                w = str(rng.randint(0, 10_000))
            else:
                w = rng.choice(["(", ")", "{", "}", "[", "]", "=", "==", "->", ":", ";", "#", "\"", "'"])
            if rng.random() < 0.15:
                w = w.capitalize()
            words.append(w)
        sep = rng.choice([". ", "! ", "? ", ", ", "\n", " - "])
        out.append(" ".join(words) + sep)
    return out


def build_tokenizer(out_dir: Path, spec: dict[str, int]) -> Any:
    """The tokenizer alone (needs tokenizers and transformers, not torch): the router's unit tests
    build it into a temporary directory to tokenize exactly as the e2e engine does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    # --- tokenizer: byte-level BPE, trained offline on generated text ---
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        min_frequency=1,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec["seed"], spec["corpus_lines"]), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[3:],
        model_max_length=spec["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build(out_dir: Path, spec: dict[str, int]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = build_tokenizer(out_dir, spec)
    vocab = len(fast)

    # --- model: random weights from a fixed seed ---
    torch.manual_seed(spec["seed"])
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"],
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    print(json.dumps({"vocab": vocab, "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    build(Path(sys.argv[1]), json.loads(sys.argv[2]))
