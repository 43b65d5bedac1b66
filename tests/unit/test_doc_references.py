"""Every reference to a document resolves inside the repository.

Code and docs cite a section as ``README, "Section"`` or ``docs/<file>.md, "Section"``, and Markdown
links to ``docs/<file>.md#anchor``; each must name a file of the repository and a heading in it
(a section whose title starts with the name followed by `` (`` counts: "Engine failures" for
"Engine failures (passive health)").  Nothing points at the documents the project started from,
which are not in it."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION_REF = re.compile(r"""(README|docs/[\w-]+\.md)(?:\.md)?(?:,\s*|\s+)(?:#\s*)?\\?["']([^"'\\\n]+)\\?["']""")
MD_LINK = re.compile(r"\]\(([^)\s]*)\)")
OUTSIDE = re.compile(r"SPEC §|SPEC\.md|ARCHITECTURE\.md|\.\./shared/|shared/seed")


def _files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    keep = ("narwhal_serve/", "deployments/", "scripts/", "tests/", "docs/", ".ci/", "deploy/")
    out = [ROOT / f for f in listed
           if (f.startswith(keep) or f in ("README.md", "Makefile", "serve_config.yaml", "pyproject.toml"))
           and not f.startswith("tests/fixtures/") and (ROOT / f).is_file()]
    return [p for p in out if p.suffix in (".py", ".md", ".yaml", ".toml", ".json", "") and p.name != Path(__file__).name]


def _anchor(heading: str) -> str:
    a = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return a.replace(" ", "-")


@cache
def _headings(path: Path) -> tuple[str, ...]:
    return tuple(m.group(1).strip() for m in re.finditer(r"(?m)^#{1,6} (.+)$", path.read_text()))


def _resolves(doc: Path, name: str) -> bool:
    return any(h == name or h.startswith(name + " (") for h in _headings(doc))


def _text(p: Path) -> str | None:
    try:
        return p.read_text()
    except UnicodeDecodeError:
        return None


def test_every_section_reference_names_a_heading_of_a_file_in_the_repository() -> None:
    bad, seen = [], 0
    for p in _files():
        text = _text(p)
        if text is None:
            continue
        for m in SECTION_REF.finditer(text):
            doc = ROOT / (m.group(1) + (".md" if m.group(1) == "README" else ""))
            seen += 1
            if not doc.is_file() or not _resolves(doc, m.group(2)):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{p.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert seen > 50, seen  # the pattern still finds the references
    assert bad == [], "\n".join(bad)


def test_every_markdown_link_to_a_repository_file_resolves() -> None:
    bad = []
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in MD_LINK.finditer(p.read_text()):
            target = m.group(1)
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file_part, _, anchor = target.partition("#")
            doc = (p.parent / file_part).resolve() if file_part else p
            if not doc.exists():
                bad.append(f"{p.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in {_anchor(h) for h in _headings(doc)}:
                bad.append(f"{p.relative_to(ROOT)}: {target} (no such heading)")
    assert bad == [], "\n".join(bad)


def test_nothing_points_outside_the_repository() -> None:
    bad = []
    for p in _files():
        text = _text(p)
        for m in OUTSIDE.finditer(text or ""):
            bad.append(f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")  # type: ignore[union-attr]
    assert bad == [], "\n".join(bad)


def test_the_readme_is_the_entry_and_links_every_document() -> None:
    readme = (ROOT / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in readme, doc.name


def test_every_package_says_what_it_holds() -> None:
    import ast

    empty = [str(p.relative_to(ROOT)) for p in [*(ROOT / "narwhal_serve").glob("*/__init__.py"), ROOT / "deployments" / "__init__.py"]
             if not ast.get_docstring(ast.parse(p.read_text()))]
    assert empty == []
