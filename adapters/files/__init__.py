"""Local mail files (.eml, mbox, Maildir) as raw bytes, for `inboxd import`."""

from __future__ import annotations

from .errors import SourceError
from .reader import (
    ImportPlan,
    RawMessage,
    SourceFile,
    iter_messages,
    plan_import,
)
from .source import IMPORT_PAGE_MAX_BYTES, IMPORT_PAGE_SIZE, ImportSource, PageRefs

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
