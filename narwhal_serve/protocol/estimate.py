"""The one characters-per-token estimate, for prompts the router cannot tokenize exactly.

Close for English prose with common tokenizers; several times too low for CJK and other non-Latin
scripts, which is why a model's tokenizer (``tokenizer:`` in the config, or a managed engine's
model directory) replaces it wherever the router has one.
"""

from __future__ import annotations

CHARS_PER_TOKEN = 4.0


def estimate_tokens(chars: int) -> int:
    """Tokens of a text of ``chars`` characters (at least one)."""
    return max(1, (chars + 3) // 4)
