"""Every package says what it holds and exports its public names: the names the rest of Narwhal
imports from its modules.  They are read on first use (``narwhal_serve/exports.py``), so importing
a package imports none of its modules."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.parent.name for p in (ROOT / "narwhal_serve").glob("*/__init__.py"))


def _used_from_outside() -> dict[str, set[str]]:
    """Per package, the names that code outside it (the rest of the package tree, deployments,
    scripts) imports from one of its modules."""
    used: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for base in ("narwhal_serve", "deployments", "scripts"):
        for f in (ROOT / base).rglob("*.py"):
            rel = f.relative_to(ROOT).parts
            mine = rel[1] if rel[0] == "narwhal_serve" and len(rel) > 2 else None
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    parts = node.module.split(".")
                    if parts[0] == "narwhal_serve" and len(parts) == 3 and parts[1] in used and parts[1] != mine:
                        used[parts[1]] |= {a.name for a in node.names if not a.name.startswith("_")}
    return used


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_exports_what_the_rest_imports_from_it(package: str) -> None:
    mod = importlib.import_module(f"narwhal_serve.{package}")
    exported = set(mod.__all__)
    # (a name that is also one of its modules' names cannot be exported: the package's attribute
    # is the module once that is imported)
    modules = {f.stem for f in (ROOT / "narwhal_serve" / package).iterdir()}
    missing = _used_from_outside()[package] - exported - modules
    assert not missing, f"narwhal_serve.{package} does not export {sorted(missing)} (add them to its _EXPORTS, __all__ and TYPE_CHECKING imports)"
    for name in sorted(exported):  # each resolves, to the object its module defines
        value = getattr(mod, name)
        home = getattr(mod, "_EXPORTS", {}).get(name)
        if home is not None:
            assert value is getattr(importlib.import_module(f"narwhal_serve.{package}.{home}"), name)
    assert set(dir(mod)) >= exported
    with pytest.raises(AttributeError):
        getattr(mod, "no_such_name")


def test_importing_a_package_imports_none_of_its_lazy_modules() -> None:
    code = (
        "import sys, importlib\n"
        f"for p in {PACKAGES!r}:\n"
        "    m = importlib.import_module('narwhal_serve.' + p)\n"
        "    for name, home in getattr(m, '_EXPORTS', {}).items():\n"
        "        key = 'narwhal_serve.' + p + '.' + home\n"
        "        if key in sys.modules:\n"
        "            print(key)\n"
    )
    # each package alone, in a fresh interpreter (another package's import may load a module)
    for p in ("admission", "scheduler", "kvevents", "replay"):
        out = subprocess.run([sys.executable, "-c", code.replace(repr(PACKAGES), repr([p]))], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert out == "", f"importing narwhal_serve.{p} imported {out.split()}"
