"""The documentation holds together: links resolve, the README stays short, citations are valid.

- Every relative link and image in ``README.md`` and ``docs/*.md`` names a file that exists,
  and an anchor (``page.md#section``) names a heading of that page, slugged as GitHub does.
- ``README.md`` stays under 16 KB: everything else lives in ``docs/``.
- Code and tests cite the design and reliability pages by section: ``docs/design.md,
  "Parity"``, ``docs/reliability.md, threat 5``, ``group D``. Every such citation anywhere in
  the tree names a page that exists and a section, threat or group that page has. The pages'
  names before they moved into ``docs/`` may only remain in ``PENDING``: files another change
  is editing. Each is to be rewritten with ``sed -i -e 's/DESIGN\\.md/docs\\/design.md/g' -e
  's/RELIABILITY\\.md/docs\\/reliability.md/g'``; the sections they cite must already exist
  in the new pages, so the rewrite is only the name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
THIS = Path(__file__).resolve()
README_MAX_BYTES = 16 * 1024

OLD_NAMES = {"DESIGN": "design", "RELIABILITY": "reliability"}
"""The starting map's page names, and the docs/ page each became."""

PENDING: frozenset[str] = frozenset()
"""Files that may still cite the old names (with sections that must exist in the new pages).
Remove an entry once the file is rewritten."""

SCANNED_SUFFIXES = frozenset({".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".proto", ".json",
                              ".txt", ".service", ".cfg", ".ini"})
SCANNED_NAMES = frozenset({"Makefile", "Dockerfile"})
SKIPPED_DIRS = frozenset({".git", ".venv", ".venv-gpu", ".venv-peers", ".venv-vllm",
                          "__pycache__", "data", ".mypy_cache", ".ruff_cache", ".pytest_cache",
                          ".hypothesis", "kvgate.egg-info", "pb", ".gpu-bundle"})


# ---- markdown -------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def heading_text(raw: str) -> str:
    """A heading as rendered: links reduced to their text, emphasis and code marks dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return text.replace("`", "").replace("**", "").replace("__", "").strip()


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before de-duplication)."""
    text = heading_text(heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The rendered text of every heading of a markdown file, in order."""
    return [heading_text(m.group(2)) for _, line in _prose_lines(path.read_text(encoding="utf-8"))
            if (m := _HEADING.match(line))]


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def _broken_link(source: Path, target: str) -> str | None:
    """Why ``target`` (as written in ``source``) does not resolve; None if it does."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    file_part, _, anchor = target.partition("#")
    destination = (source.parent / file_part).resolve() if file_part else source
    if not destination.exists():
        return f"{file_part}: no such file"
    if anchor:
        if destination.suffix != ".md" or destination.is_dir():
            return f"#{anchor}: anchors are only checked in markdown files"
        if anchor not in anchors(destination):
            return f"#{anchor}: no such heading in {destination.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    broken = [f"line {number}: ({target}) {why}" for number, target in _links(path)
              if (why := _broken_link(path, target)) is not None]
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_checker_sees_links_and_anchors() -> None:
    """A guard on the checker itself: the README links into docs/ with anchors, and a broken
    target or anchor is reported."""
    readme = ROOT / "README.md"
    targets = [target for _, target in _links(readme)]
    assert "docs/README.md" in targets
    assert any("#" in target and target.startswith("docs/") for target in targets)
    assert _broken_link(readme, "docs/no-such-page.md") is not None
    assert _broken_link(readme, "docs/design.md#no-such-section") is not None
    assert _broken_link(readme, "docs/design.md#parity") is None
    assert github_slug("Index: `kvgate bench index`") == "index-kvgate-bench-index"
    assert github_slug("On a GPU: an H100 (2026-11-23)") == "on-a-gpu-an-h100-2026-11-23"


def test_the_readme_stays_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes (> {README_MAX_BYTES}): move detail into a page of docs/")


def test_the_docs_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    unlisted = [p.name for p in sorted(DOCS.glob("*.md"))
                if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not link {unlisted}"


# ---- citations of the design and reliability pages -----------------------------------------

_REFERENCE = re.compile(r"\bdocs/([a-z_]+)\.md\b|\b([A-Z]+)\.md\b")


@dataclass(frozen=True)
class Citation:
    """One reference to a documentation page found in the tree, and what it names there."""

    path: str
    page: str
    old_name: str | None
    sections: tuple[str, ...]
    threats: tuple[str, ...]
    groups: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.path}: {self.old_name or 'docs/' + self.page}.md"


def _normalised(text: str) -> str:
    """The text with each line's indentation and comment marks dropped, lines joined by spaces,
    so that a citation wrapped over two comment lines reads as one."""
    return " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())


def _window(text: str, start: int) -> tuple[str, list[str]]:
    """What follows a reference, up to the end of its clause: the top-level text (parenthesised
    parts dropped) and the quoted names at the top level."""
    depth = 0
    plain: list[str] = []
    quoted: list[str] = []
    i = start
    end = min(len(text), start + 400)
    while i < end:
        ch = text[i]
        if text.startswith('"""', i) or _REFERENCE.match(text, i):
            break
        if ch in "()":
            if ch == ")" and depth == 0:
                break
            depth += 1 if ch == "(" else -1
            i += 1
            continue
        if depth == 0 and ch == "." and (i + 1 == len(text) or text[i + 1].isspace()):
            break
        elif depth == 0 and ch == '"':
            close = text.find('"', i + 1)
            if close == -1 or close - i > 80:
                break
            quoted.append(text[i + 1:close])
            plain.append(" ")
            i = close + 1
            continue
        if depth == 0:
            plain.append(ch)
        i += 1
    return "".join(plain), quoted


def _numbered(pattern: str, item: str, text: str) -> tuple[str, ...]:
    """Every ``item`` in the lists that ``pattern`` (one group) finds: "groups D and E"
    gives D and E."""
    found: list[str] = []
    for match in re.finditer(pattern, text):
        found.extend(re.findall(item, match.group(1)))
    return tuple(found)


def citations_in(path: Path) -> list[Citation]:
    text = _normalised(path.read_text(encoding="utf-8", errors="replace"))
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    found = []
    for match in _REFERENCE.finditer(text):
        page: str | None = match.group(1)
        old: str | None = match.group(2)
        if old is not None and old not in (*OLD_NAMES, "STYLE"):
            continue  # the README and other files that are not the design pages
        plain, quoted = _window(text, match.end())
        if page is None:
            assert old is not None  # the pattern matches one of the two
            page = OLD_NAMES.get(old, old.lower())
        found.append(Citation(
            path=rel,
            page=page,
            old_name=old,
            sections=tuple(quoted),
            threats=_numbered(r"\bthreats?\s+(\d+(?:\s*(?:,|and)\s*\d+)*)", r"\d+", plain),
            groups=_numbered(r"\bgroups?\s+([A-G]\b(?:\s*(?:,|and)\s*[A-G]\b)*)", r"[A-G]",
                             plain),
        ))
    return found


def _scanned_files() -> list[Path]:
    files = []
    for directory, subdirs, names in os.walk(ROOT):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        for name in sorted(names):
            path = Path(directory) / name
            if path.resolve() != THIS and (path.suffix in SCANNED_SUFFIXES
                                           or name in SCANNED_NAMES):
                files.append(path)
    return files


def _problems(citation: Citation) -> list[str]:
    page = DOCS / f"{citation.page}.md"
    if not page.is_file():
        return [f"{citation.where}: no page docs/{citation.page}.md"]
    titles = headings(page)
    problems = [f'{citation.where}: no section "{name}" in docs/{citation.page}.md'
                for name in citation.sections if name not in titles]
    problems += [f"{citation.where}: no heading 'Threat {n}' in docs/{citation.page}.md"
                 for n in citation.threats
                 if not any(re.match(rf"Threat {n}\b", title) for title in titles)]
    problems += [f"{citation.where}: no heading 'Group {g}' in docs/{citation.page}.md"
                 for g in citation.groups
                 if not any(re.match(rf"Group {g}\b", title) for title in titles)]
    return problems


def _pending(path: str) -> bool:
    return path in PENDING


def test_every_citation_names_a_page_and_a_section_that_exist() -> None:
    problems = []
    for path in _scanned_files():
        for citation in citations_in(path):
            if citation.old_name == "STYLE":
                problems.append(f"{citation.where}: the style guide is not part of the "
                                f'repository; cite docs/contributing.md, "Conventions"')
                continue
            if citation.old_name is not None and not _pending(citation.path):
                problems.append(f"{citation.where}: cite docs/{citation.page}.md instead")
            problems += _problems(citation)
    assert not problems, "\n".join(problems)


def test_the_citation_reader_finds_sections_threats_and_groups(tmp_path: Path) -> None:
    """A guard on the reader: the citation forms the code uses are all understood."""
    sample = tmp_path / "citation_sample.py"
    sample.write_text((
        '"""A sample (docs/design.md, "The radix index" and "Blocks"), see\n'
        "docs/reliability.md test groups D (tenants, authN/Z) and E (API abuse). And\n"
        '(docs/reliability.md threat 1, test group D\'s timing audit); (docs/design.md "Parity":\n'
        "today's route)."
        '"""\n'
    ), encoding="utf-8")
    found = citations_in(sample)
    assert [(c.page, c.sections, c.threats, c.groups) for c in found] == [
        ("design", ("The radix index", "Blocks"), (), ()),
        ("reliability", (), (), ("D", "E")),
        ("reliability", (), ("1",), ("D",)),
        ("design", ("Parity",), (), ()),
    ]
    assert _problems(Citation("x.py", "design", None, ("No such section",), (), ()))
    assert _problems(Citation("x.py", "reliability", None, (), ("9",), ()))
    assert not _problems(Citation("x.py", "reliability", None, ("Harness",), ("5",), ("C",)))
