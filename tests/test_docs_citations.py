"""Docstrings and comments cite the repository, never files outside it or issue numbers.

A clone must be able to follow every citation. The papers and notes the project started
from live outside the repository, and an issue number means nothing without the tracker, so
the sources of ``p2pfl/``, ``scripts/`` and ``tests/`` cite a document of the repository and
one of its headings instead, e.g. ``docs/algorithms.md, "UA-PDFL"``; this test checks that
the document and the heading exist.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("p2pfl", "scripts", "tests")

# built so that this file does not match them itself
FORBIDDEN = (
    ("a note outside the repository", re.compile(r"\b(?:ALGORITHMS|DESIGN)\.md\b")),
    ("a path outside the repository", re.compile(r"\.\./shared[/\\]")),
    ("a paper's text file", re.compile(r"\b[0-9]{3}_[0-9a-f]{16}\.txt\b")),
    ("an issue number", re.compile(r"\bissues?\s+#?[0-9]+", re.IGNORECASE)),
)
# a command-line example may point at the data directory beside the checkout
DATA_ROOT_LINE = ("--data-root", "dataset.root")

DOC = r"(docs/[\w.-]+\.md|README\.md)"
CITATION = re.compile(DOC + r',\s*(?:#\s*)?"([^"\n]+)"')
MORE_HEADINGS = re.compile(r'\s*(?:,|and)\s*(?:#\s*)?"([^"\n]+)"')
DOC_MENTION = re.compile(r"\bdocs/[\w.-]+\.md\b")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def sources() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))


def _line(text: str, pos: int) -> tuple[int, str]:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text.count("\n", 0, pos) + 1, text[start : end if end >= 0 else len(text)]


def forbidden(text: str) -> list[tuple[int, str, str]]:
    """``(line number, what, line)`` for every reference that leads outside the repository."""
    found = []
    for what, pattern in FORBIDDEN:
        for m in pattern.finditer(text):
            lineno, line = _line(text, m.start())
            if what.startswith("a path") and any(k in line for k in DATA_ROOT_LINE):
                continue
            found.append((lineno, what, line.strip()))
    return found


def citations(text: str) -> list[tuple[int, str, str | None]]:
    """``(line number, document, heading)`` for every cited heading, and ``heading`` None
    for a document mentioned without one."""
    found: list[tuple[int, str, str | None]] = []
    cited_at = set()
    for m in CITATION.finditer(text):
        lineno, _ = _line(text, m.start())
        found.append((lineno, m.group(1), m.group(2)))
        cited_at.add(m.start())
        end = m.end()
        while more := MORE_HEADINGS.match(text, end):
            found.append((lineno, m.group(1), more.group(1)))
            end = more.end()
    for m in DOC_MENTION.finditer(text):
        if m.start() not in cited_at:
            found.append((_line(text, m.start())[0], m.group(0), None))
    return found


def headings(path: Path) -> set[str]:
    """The text of every Markdown heading in ``path``, any level, outside fenced code."""
    out, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            out.add(m.group(1))
    return out


def broken(cites: list[tuple[int, str, str | None]]) -> list[str]:
    """Why each citation cannot be followed: a missing document or heading."""
    problems = []
    for lineno, doc, heading in cites:
        path = ROOT / doc
        if not path.is_file():
            problems.append(f"line {lineno}: {doc} does not exist")
        elif heading is not None and heading not in headings(path):
            problems.append(f'line {lineno}: {doc} has no heading "{heading}"')
    return problems


def test_sources_cite_nothing_outside_the_repository():
    bad = [
        f"{path.relative_to(ROOT)}:{lineno}: {what}: {line}"
        for path in sources()
        for lineno, what, line in forbidden(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "cite docs/ or README.md instead:\n" + "\n".join(bad)


def test_cited_documents_and_headings_exist():
    bad = [
        f"{path.relative_to(ROOT)}: {problem}"
        for path in sources()
        for problem in broken(citations(path.read_text(encoding="utf-8")))
    ]
    assert not bad, "\n".join(bad)
    cited = {doc for path in sources() for _, doc, _ in citations(path.read_text("utf-8"))}
    assert {"docs/algorithms.md", "docs/wire.md", "docs/design.md"} <= cited


def test_the_checks_catch_violations():
    outside = "ALGORITHMS" + ".md"
    text = "\n".join(
        [
            f'"""Implements {outside}, "UA-PDFL" (seed ``' + "002_cc91c9f51018c876" + ".txt``).",
            "Fixed in issue" + " 5; see the closing note of Issue" + " 3.",
            "Data in .." + "/shared" + "/data.",
            "    p2pfl swarm t.yaml --data-root .." + "/shared" + "/data",
            '"""',
        ]
    )
    found = [(lineno, what) for lineno, what, _ in forbidden(text)]
    assert sorted(found) == [
        (1, "a note outside the repository"),
        (1, "a paper's text file"),
        (2, "an issue number"),
        (2, "an issue number"),
        (3, "a path outside the repository"),
    ]

    docs = "docs/"
    good = docs + 'algorithms.md, "UA-PDFL" and ' + docs + 'wire.md,\n    "Topics" and "Codec"'
    assert broken(citations(good)) == []
    bad = "\n".join(
        [
            docs + 'algorithms.md, "No such heading"',
            docs + 'nowhere.md, "UA-PDFL"',
            "see " + docs + "nowhere.md",
            "README.md" + ', "Results" and "No such section"',
            "# " + docs + 'wire.md, "Envelope"',  # a comment: fine
        ]
    )
    assert broken(citations(bad)) == [
        f'line 1: {docs}algorithms.md has no heading "No such heading"',
        f"line 2: {docs}nowhere.md does not exist",
        'line 4: README.md has no heading "No such section"',
        f"line 3: {docs}nowhere.md does not exist",
    ]
