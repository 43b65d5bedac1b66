"""A package's public names, imported on first use (PEP 562): a package ``__init__`` lists each name
with the module that defines it, and importing the package imports none of those modules, so no
import cycle can start at a package's door.  Imports nothing of the project."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's ``__getattr__`` and ``__dir__``, given its ``globals()``: ``exports`` maps a
    public name to the package's module that defines it (the value is kept in the package once
    read)."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
