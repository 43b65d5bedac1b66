"""Developer and CI scripts (importable so tests can reuse their functions)."""
