"""Prometheus text exposition: a label value as the format writes it (backslash, double quote and
newline escaped, as prometheus_client writes them), for every page Narwhal renders."""

from __future__ import annotations


def escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
