"""Local mail files (.eml, mbox, Maildir) as raw bytes, for `inboxd import`."""

from __future__ import annotations

from .pages import IMPORT_PAGE_MAX_BYTES, IMPORT_PAGE_SIZE, ImportSource, PageRefs
from .source import (
    ImportPlan,
    RawMessage,
    SourceError,
    SourceFile,
    iter_messages,
    plan_import,
)

__all__ = [
    "IMPORT_PAGE_MAX_BYTES",
    "IMPORT_PAGE_SIZE",
    "ImportPlan",
    "ImportSource",
    "PageRefs",
    "RawMessage",
    "SourceError",
    "SourceFile",
    "iter_messages",
    "plan_import",
]
