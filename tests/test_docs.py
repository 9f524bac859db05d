"""The user docs hold together: links resolve, the README stays a newcomer's page.

Checks README.md, CHANGELOG.md and every docs/**/*.md:

- every relative link and image resolves to a file in the tree, and a ``#anchor`` to a heading
  of its target (GitHub's anchor rule);
- every ``[Note: name] in `path` `` names a Note that ``path`` holds, and every ``[Note: name]``
  one that some file under autopipe/ or executor/ holds;
- the README is at most 250 lines, its first Python example starts within its first 60, and it
  keeps the install, test and end-to-end commands that CI and newcomers run.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_NOTE = re.compile(r"\[Note: ([^\]]+)\](?: in `([^`]+)`)?")


def _prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks and indented code (4 spaces after a blank)."""
    lines, fenced, prev_blank = [], False, True
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            lines.append("")
            continue
        code = fenced or (line.startswith("    ") and prev_blank and not line.lstrip().startswith("-"))
        lines.append("" if code else line)
        prev_blank = (not line.strip()) or (code and prev_blank)
    return lines


def _slug(text: str) -> str:
    """GitHub's heading anchor: lower case, markup and punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(_prose(path), 1):
        for m in _LINK.finditer(line):
            found.append((number, m.group(1)))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for number, target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        where = f"{doc.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _one_line(text: str) -> str:
    """Text with line breaks (and a comment's leading #) folded into single spaces."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


@cache
def _code_notes() -> str:
    return "\n".join(_one_line(p.read_text(encoding="utf-8"))
                     for pkg in ("autopipe", "executor") for p in sorted((ROOT / pkg).rglob("*.py")))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notes_named_in_docs_exist(doc: Path) -> None:
    missing = []
    for m in _NOTE.finditer(_one_line("\n".join(_prose(doc)))):
        name, path = m.group(1), m.group(2)
        if name.endswith("...") or name == "...":
            continue
        tag = f"[Note: {name}]"
        # a path from the root, or (as DESIGN.md writes them) from inside autopipe/
        file = next((f for f in (ROOT / path, ROOT / "autopipe" / path) if f.is_file()),
                    None) if path else None
        if file is not None:
            if tag not in _one_line(file.read_text(encoding="utf-8")):
                missing.append(f"{tag} is not in {path}")
        elif path and "/" in path and path.endswith(".py"):
            missing.append(f"{tag}: no file {path}")
        elif tag not in _code_notes():
            missing.append(f"{tag} is in no file under autopipe/ or executor/")
    assert not missing, f"{doc.relative_to(ROOT)}:\n" + "\n".join(missing)


def test_readme_is_a_newcomers_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
    first_python = next(i for i, line in enumerate(lines, 1) if line.strip() == "```python")
    assert first_python <= 60, f"README's first Python example starts at line {first_python}"


@pytest.mark.parametrize("command", [
    'pip install -e ".[dev]"',
    "pip install torch==2.13.0",
    "python -m pytest -q",
    "bash .ci/run",
    "autopipe train mlp --stages 2 --chunks 4",
])
def test_readme_keeps_its_commands(command: str) -> None:
    assert command in README.read_text(encoding="utf-8")


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pytest -q" in ci and 'pip install --quiet -e ".[dev]"' in ci


def _packages() -> list[Path]:
    return [init.parent for top in ("autopipe", "executor")
            for init in sorted((ROOT / top).rglob("__init__.py"))]


# an indented line of a package docstring that starts with a name and two spaces (or a comma,
# as in "replay, layerwise  ...") names a module or sub-package of that package
_MAP_ENTRY = re.compile(r"^\s+(\w+)(?:\.py|/)?(?:\s{2,}|,)", re.M)


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_docstring_maps_its_modules(package: Path) -> None:
    """Each package's ``__init__`` docstring names every module and sub-package it holds, and
    each of its map's entries exists: the map a newcomer reads first stays true."""
    import ast

    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    members = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    members |= {d.name for d in package.iterdir() if (d / "__init__.py").is_file()}
    unnamed = sorted(m for m in members
                     if not re.search(rf"(?<![\w.]){re.escape(m)}(\.py|/)?(?!\w)", doc))
    assert unnamed == [], f"{package.relative_to(ROOT)}/__init__.py does not name {unnamed}"
    stale = sorted(set(_MAP_ENTRY.findall(doc)) - members)
    assert stale == [], f"{package.relative_to(ROOT)}/__init__.py names {stale}, which it lacks"
