"""Reading an SSE body in tests."""

from __future__ import annotations

import json
from typing import Any


def parse_sse(text: str) -> list[Any]:
    """Data payloads of an SSE body: parsed JSON, or the raw string (``[DONE]``, malformed lines)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                try:
                    out.append(json.loads(payload))
                except ValueError:
                    out.append(payload)
    return out
