"""Files of the shared mail corpus (tests/corpus/mime), picked one way everywhere.

The corpus is raw RFC 822 samples in files, never edited (CONTRIBUTING "Tests");
a test takes a folder of it (all of `mime/`, or one source such as
`mime/mailgun-flanker`) and the first files in path order, so that the same files
come back on every machine.
"""

from __future__ import annotations

from pathlib import Path


def corpus_files(folder: Path, count: int | None = None) -> list[Path]:
    """The .eml files under `folder` (subfolders included) in path order; the first
    `count` of them when given."""
    files = sorted(folder.rglob("*.eml"))
    return files if count is None else files[:count]
