"""Every repository path a docstring or a document names exists.

Module docstrings and docs/ are the map a reader follows (docs/architecture.md,
CONTRIBUTING.md); a path that moved without them sends the reader nowhere. This
test reads every module, class and function docstring of the source, test and
benchmark folders, and every Markdown document, picks out the words that start
with a top-level folder of the repository (`pipeline/ingest/stage.py`,
`adapters/ses/`, `tests/fakes/gmail`) and checks each names a file or folder
that exists. Patterns (`*`, `{a,b}`, `<name>`) are not paths and are skipped.

No database: this test only reads files.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The top-level folders a repository path starts with.
TOP_FOLDERS = (
    "adapters",
    "bench",
    "daemon",
    "deploy",
    "docs",
    "pipeline",
    "scripts",
    "systemd",
    "tests",
    "config.example.tenants",
)
PYTHON_FOLDERS = ("adapters", "bench", "daemon", "pipeline", "scripts", "tests")
#: A word starting with a top folder and a slash, not inside a longer path or URL.
PATH_RE = re.compile(
    r"(?<![\w./:@~$-])((?:" + "|".join(re.escape(f) for f in TOP_FOLDERS) + r")/[\w./@*{}<>…-]*)"
)
#: Characters that make a word a pattern or a placeholder rather than a path.
NOT_A_PATH = re.compile(r"[*{}<>…]|\.\.\.")


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                line = node.body[0].lineno if node.body else 1
                yield line, doc


def _texts() -> Iterator[tuple[str, int, str]]:
    for folder in PYTHON_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO)
            if any(p.startswith(".") or p in ("__pycache__", "corpus") for p in rel.parts):
                continue
            for line, doc in _docstrings(path):
                yield rel.as_posix(), line, doc
    for path in sorted(REPO.rglob("*.md")):
        rel = path.relative_to(REPO)
        if any(p.startswith(".") or p in ("corpus", "node_modules") for p in rel.parts):
            continue
        if rel.parts[0] in ("var",) or "egg-info" in rel.parts[0]:
            continue
        yield rel.as_posix(), 1, path.read_text(encoding="utf-8")


def _names_a_missing_path(word: str) -> bool:
    if NOT_A_PATH.search(word):
        return False
    word = word.rstrip(".,;:")
    if (REPO / word).exists():
        return False
    # `pipeline/outbox.py`'s function written `pipeline/outbox.notify`: the module counts
    module, dot, _attribute = word.rpartition(".")
    return not (dot and (REPO / f"{module}.py").is_file())


def test_every_path_a_docstring_or_document_names_exists() -> None:
    missing = sorted(
        {
            f"{where}:{line + text.count(chr(10), 0, match.start())}: "
            f"{match.group(1).rstrip('.,;:')}"
            for where, line, text in _texts()
            for match in PATH_RE.finditer(text)
            if _names_a_missing_path(match.group(1))
        }
    )
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
