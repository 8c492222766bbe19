"""The documentation's references resolve: every repository path the README, docs/ and the results index name exists,
and every section a code comment cites by title (`docs/int4_decode.md, "Title"`) is a heading of that file. The
measurement notes moved from the README to docs/ once already; these catch a reference left behind by the next move
or rename."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "evals" / "results" / "README.md"]
PATH = re.compile(
    r"(?<![\w/.])((?:docs|evals/results|kernels|patcher|tools|tests)/[\w./-]+\.(?:md|json|txt|png|cuh|cu|h|cpp|py|sh))\b"
)
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # tpot_NAME.json, tpot_MODEL...: a pattern, not a file
CITATION = re.compile(r'(docs/\w+\.md), "([^"]+)"')
CODE_SUFFIXES = {".cu", ".cuh", ".h", ".cpp", ".py"}


def code_files() -> list[Path]:
    folders = ("kernels", "patcher", "evals", "tools")
    return sorted(p for d in folders for p in (ROOT / d).rglob("*") if p.suffix in CODE_SUFFIXES)


def as_prose(source: str) -> str:
    """Comment lines joined into one line each, so that a citation wrapped over two comment lines is found whole."""
    return re.sub(r"\s*\n\s*(?://|#)?\s*", " ", source)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc):
    named = {m.group(1) for m in PATH.finditer(doc.read_text())}
    missing = sorted(p for p in named if not (ROOT / p).exists() and not PLACEHOLDER.search(p))
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_cited_sections_exist():
    cited = 0
    for path in code_files():
        for doc, title in CITATION.findall(as_prose(path.read_text())):
            headings = [line for line in (ROOT / doc).read_text().splitlines() if line.startswith(("#", "**"))]
            assert any(title in h for h in headings), (
                f'{path.relative_to(ROOT)} cites "{title}" in {doc}: no such heading'
            )
            cited += 1
    assert cited > 0, "no citation found: the pattern no longer matches how the code cites docs/"
