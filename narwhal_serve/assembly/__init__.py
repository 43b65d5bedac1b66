"""Engine-output assembly: token-identity checks, client exposure, non-streaming assembly.

Pure functions and classes over parsed JSON dicts (no I/O, no Ray/HTTP imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

from .exposure import expose
from .fold import Assembler
from .tokens import CHAT_GENERATED, COMPLETION_GENERATED, check_prompt_token_ids, check_token_ids

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "usage_chunk": "usage",
}
__all__ = [
    "Assembler", "CHAT_GENERATED", "COMPLETION_GENERATED", "check_prompt_token_ids", "check_token_ids", "expose",
    "usage_chunk",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.assembly.usage import usage_chunk as usage_chunk
