"""The documentation holds together: every repository path and result file the README, docs/ and the results index
name exists, every section cited by title (`docs/<file>.md, "<heading>"` in code comments, `[<file>.md](<file>.md),
"<heading>"` in the docs) is a heading (or a bold paragraph start) of that file, and the README stays within 250 lines.

`test_no_development_narration` keeps the repository free of its own development log: no tracked file's name, no
text of the README, docs/ or the results index, and no comment or docstring of the code in patcher/, kernels/,
evals/, tests/ may contain the words it looks for (history lives in git log; comments state invariants and reasons).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = next(
    p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file()
)  # wherever tests/ nests this
RESULTS = ROOT / "evals" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]
README_MAX_LINES = 250

PATH = re.compile(
    r"(?<![\w/.])((?:docs|evals|kernels|patcher|tools|tests|\.ci)/[\w./-]+\.(?:md|json|txt|png|cuh|cu|h|cpp|py|sh))\b"
)
RESULT_NAME = re.compile(r"`([\w.{},-]+\.(?:json|png|txt))`")  # a result file named without its folder
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # tpot_MODEL_int4_h100.json, evals/results/tpot_NAME.json: a pattern
CODE_CITATION = re.compile(r'(docs/[\w-]+\.md), "([^"]+)"')
DOC_CITATION = re.compile(r'\]\(([\w-]+\.md)\), "([^"]+)"')
CODE_SUFFIXES = {".cu", ".cuh", ".h", ".cpp", ".py", ".sh"}
CODE_FOLDERS = ("patcher", "kernels", "evals", "tests")
# Each word written in two halves, so that this file, which the test reads too, does not contain it.
NARRATION = re.compile("ses" + "sion|throw" + "away", re.IGNORECASE)


def expand(name: str) -> list[str]:
    """`tpot_{a,b}_x.json` -> [tpot_a_x.json, tpot_b_x.json] (the results index abbreviates sets of files)."""
    match = re.search(r"\{([^{}]*)\}", name)
    if not match:
        return [name]
    return [n for part in match.group(1).split(",") for n in expand(name[: match.start()] + part + name[match.end() :])]


def tracked_files() -> list[Path]:
    """The files git tracks; where this is not a git checkout, every file under the root but those in hidden folders
    (.git, and the untracked data and build folders a copy of the tree may carry)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = (p for p in ROOT.rglob("*") if p.is_file())
        return [p for p in files if not any(part.startswith(".") for part in p.relative_to(ROOT).parts[:-1])]


def code_files() -> list[Path]:
    return sorted(p for d in CODE_FOLDERS for p in (ROOT / d).rglob("*") if p.suffix in CODE_SUFFIXES)


def comments(path: Path) -> str:
    """The comments and docstrings of a code file, one per line (a citation wrapped over two comment lines joins
    into one line)."""
    source = path.read_text()
    if path.suffix == ".py":
        nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        found = [ast.get_docstring(n, clean=False) for n in ast.walk(ast.parse(source)) if isinstance(n, nodes)]
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        found += [tok.string.lstrip("#") for tok in tokens if tok.type == tokenize.COMMENT]
        text = "\n".join(f for f in found if f)
    elif path.suffix == ".sh":
        text = "\n".join(line.split("#", 1)[1] for line in source.splitlines() if "#" in line)
    else:
        blocks = re.findall(r"//([^\n]*)|/\*(.*?)\*/", source, re.DOTALL)
        text = "\n".join(a or b for a, b in blocks)
    return re.sub(r"\s*\n\s*(?://|#|\*)?\s*", " ", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc):
    text = doc.read_text()
    named = {m.group(1) for m in PATH.finditer(text)}
    missing = sorted(p for p in named if not (ROOT / p).exists() and not PLACEHOLDER.search(p))
    results = {n for m in RESULT_NAME.finditer(text) for n in expand(m.group(1)) if not n.startswith(".")}
    missing += sorted(f"evals/results/{n}" for n in results if not (RESULTS / n).exists() and not PLACEHOLDER.search(n))
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def headings(doc: Path) -> list[str]:
    return [line for line in doc.read_text().splitlines() if line.startswith(("#", "**"))]


def test_cited_sections_exist():
    cited = []
    for path in code_files():
        cited += [(path, ROOT / doc, title) for doc, title in CODE_CITATION.findall(comments(path))]
    for doc in DOCS:
        prose = re.sub(r"\s*\n\s*", " ", doc.read_text())
        cited += [(doc, doc.parent / name, title) for name, title in DOC_CITATION.findall(prose)]
    assert cited, "no citation found: the patterns no longer match how the code and docs cite docs/"
    wrong = []
    for source, doc, title in cited:
        if not doc.is_file():
            wrong.append(f'{source.relative_to(ROOT)} cites "{title}" in {doc.relative_to(ROOT)}, which does not exist')
        elif not any(title in h for h in headings(doc)):
            wrong.append(f'{source.relative_to(ROOT)} cites "{title}" in {doc.name}: no such heading')
    assert not wrong, "\n".join(wrong)


def test_readme_length():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_no_development_narration():
    found = [f"file name: {p.relative_to(ROOT)}" for p in tracked_files() if NARRATION.search(str(p.relative_to(ROOT)))]
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if NARRATION.search(line):
                found.append(f"{doc.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    for path in code_files():
        text = comments(path)
        for match in NARRATION.finditer(text):
            context = text[max(0, match.start() - 60) : match.end() + 40]
            found.append(f"{path.relative_to(ROOT)} (comment): ...{context}...")
    assert not found, "the repository narrates its development (history belongs in git log):\n" + "\n".join(found)
