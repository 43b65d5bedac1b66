"""Engine-output assembly: token-identity checks, client exposure, non-streaming assembly.

Pure functions and classes over parsed JSON dicts (no I/O, no Ray/HTTP imports).
"""

from __future__ import annotations

from .exposure import expose
from .fold import Assembler
from .tokens import check_prompt_token_ids, check_token_ids

__all__ = ["Assembler", "check_prompt_token_ids", "check_token_ids", "expose"]
